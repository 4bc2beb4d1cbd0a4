"""Arms: parsing --arm, and what each server is started with."""

from __future__ import annotations

import sys

import pytest

from nanoserve.bench.arms import ArmOptions, Server, parse_arm


def test_parse_arm():
    assert parse_arm("hf").kind == "hf"
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
