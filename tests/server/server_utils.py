"""Helpers for tests against real server processes on 127.0.0.1 with ephemeral ports."""

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
STARTUP_TIMEOUT_S = 180


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
    """`python -m nanoserve.cli serve ...` as a subprocess, with its log in a file."""

    def __init__(self, model: Path, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "nanoserve.cli", "serve", "--model", str(model),
            "--port", str(self.port), "--num-kv-blocks", "512", "--log-level", "warning",
            "--shutdown-timeout", "3", *args,
        ]  # fmt: skip
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

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


def read_metrics(url: str) -> dict[str, float]:
    """Every sample on /metrics as {"name{label=value,...}": value} (model_name dropped)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
            )
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
