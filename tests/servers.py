"""The one set of helpers for tests against real `nanoserve serve` processes on 127.0.0.1 with
ephemeral ports: start one, wait for /health, list its worker, read its metrics, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-123"
STARTUP_TIMEOUT_S = 240
# float32: the test checkpoints are float32 and transformers (the oracle) runs them in float32;
# `--dtype auto` would serve them in bfloat16 as vLLM does.
TEST_FLAGS = [
    "--num-kv-blocks", "512", "--log-level", "warning", "--shutdown-timeout", "3",
    "--dtype", "float32",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid:
            children.append(int(entry))
    return children


class ServerProcess:
    """`nanoserve serve ...` as a subprocess on a free port, with its log in a file.

    `test_flags` adds a small fixed KV pool, quiet logs and a short shutdown grace; `command`
    replaces `python -m nanoserve.cli.main` (e.g. the installed console script).
    """

    def __init__(
        self,
        model: Path | None,
        log_path: Path,
        *args: str,
        command: list[str] | None = None,
        test_flags: bool = True,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [*(command or [sys.executable, "-m", "nanoserve.cli.main"]), "serve"]
        if model is not None:
            argv += ["--model", str(model)]
        argv += ["--port", str(self.port)]
        if test_flags:
            argv += TEST_FLAGS
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([*argv, *args], stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def worker_pids(self) -> list[int]:
        return child_pids(self.process.pid)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        self.wait_healthy()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def read_metrics(url: str) -> dict[str, float]:
    """Every sample on /metrics as {"name{label=value,...}": value} (model_name dropped).

    A sample labelled with its data-parallel `engine` is also summed over the engines under
    its name without that label: "vllm:num_requests_running" is the total.
    """
    text = httpx.get(f"{url}/metrics", timeout=5).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            samples[metric_key(sample.name, labels)] = sample.value
            if "engine" in labels:
                del labels["engine"]
                total = metric_key(sample.name, labels)
                samples[total] = samples.get(total, 0.0) + sample.value
    return samples


def metric_key(name: str, labels: dict[str, str]) -> str:
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{text}}}" if text else name
