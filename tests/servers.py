"""The one set of helpers for tests against servers on 127.0.0.1 with ephemeral ports.

Two kinds, one interface (`url`, `port`, `wait_healthy`, `log`, `engine_ids`, `pids`, `stop`, a
context manager), both taking `nanoserve serve`'s flags:

- `InProcessServer`: the real app (`create_app`, nanoserve's h11 protocol with its deadlines,
  `GracefulServer`) served by uvicorn from a thread of this process, against a real engine on
  another thread (`InProcessEngineClient`). Starts in about a second: most server tests use it.
- `ServerProcess`: `nanoserve serve ...` as a subprocess, with its worker process. For what is
  about processes: start-up, worker deaths and restarts, heartbeats, signals, parallel ranks,
  the command line, the memory of the front process.

`build_test_engine` is the one place where tests build an engine for a server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.common.config import EngineConfig

API_KEY = "test-key-123"
STARTUP_TIMEOUT_S = 240
STOP_TIMEOUT_S = 30
# float32: the test checkpoints are float32 and transformers (the oracle) runs them in float32;
# `--dtype auto` would serve them in bfloat16 as vLLM does.
TEST_FLAGS = [
    *("--num-kv-blocks", "512"),
    *("--log-level", "warning"),
    *("--shutdown-timeout", "3"),
    *("--dtype", "float32"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` that have started their own program, from /proc.

    A child between fork and exec still runs the parent's command line and is left out: Python
    starts subprocesses with vfork, so stopping (SIGSTOP) such a child would stop its parent too.
    """
    try:
        parent_command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:  # its parent's pid
                continue
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if command != parent_command:
            children.append(int(entry))
    return children


def build_test_engine(config: EngineConfig):
    """The engine of an in-process test server: the one a worker process builds."""
    from nanoserve.worker.ranks import RankPlacement, make_engine

    return make_engine(config, RankPlacement())


def wait_healthy(url: str, is_alive, log, timeout_s: float) -> None:
    """Poll /health until it answers 200; fail at once if the server died (`is_alive()`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive():
            raise RuntimeError(f"the server at {url} stopped:\n{log()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # paces the poll
    raise TimeoutError(f"server not healthy after {timeout_s} s:\n{log()}")


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
        wait_healthy(self.url, lambda: self.process.poll() is None, self.log, timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def worker_pids(self) -> list[int]:
        return child_pids(self.process.pid)

    def engine_ids(self) -> list[int]:
        """What serves the requests (its worker processes); a restart changes it."""
        return self.worker_pids()

    def pids(self) -> list[int]:
        """The processes of this server: the front and its workers."""
        return [self.process.pid, *self.worker_pids()]

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; the exit code. Its workers end with it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                workers = self.worker_pids()  # killed with the front, not left as orphans
                self.process.kill()
                self.process.wait()
                for pid in workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class InProcessServer:
    """The real HTTP app and a real engine in this process, each on a thread of its own.

    The flags are `nanoserve serve`'s, read by its own parser and config checks; the app, the
    h11 protocol with its deadlines and the graceful shutdown are the ones `serve` runs. What the
    `nanoserve` and `uvicorn` loggers record on this server's threads (and while it is built)
    goes to `log_path`, as a server process's output goes to its log.
    """

    def __init__(self, model: Path | str, log_path: Path, *args: str) -> None:
        from nanoserve.client.inprocess import InProcessEngineClient
        from nanoserve.server.app import create_app

        self.log_path = log_path
        self._log_threads = {threading.get_ident()}  # whose records are this server's
        self.client: InProcessEngineClient | None = None
        level = _flag(args, "--log-level", "warning")
        self._log_handler = _attach_log(log_path, level, self._is_own_record)
        try:
            config, server_config, tokenizer, grace_s = _configs_from_flags(model, args)
            self.client = InProcessEngineClient(build_test_engine(config))
            app = create_app(server_config, self.client, tokenizer, shutdown_timeout_s=grace_s)
            self._sock = _bound_socket()
        except BaseException:
            _detach_log(self._log_handler)
            raise
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = _uvicorn_server(app, server_config, self.client, grace_s)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name=f"nanoserve-test-server-{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._log_threads = {self._thread.ident or 0}

    def _is_own_record(self, record: logging.LogRecord) -> bool:
        """Logged by the server's thread, by its engine's, or while the server was built."""
        engine_thread = self.client._thread if self.client is not None else None
        return record.thread in self._log_threads or (
            engine_thread is not None and record.thread == engine_thread.ident
        )

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_healthy(self.url, self._thread.is_alive, self.log, timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def engine_ids(self) -> list[int]:
        """What serves the requests (the engine thread, while it runs)."""
        thread = self.client._thread
        return [thread.ident] if thread is not None and thread.is_alive() and thread.ident else []

    def pids(self) -> list[int]:
        """The processes of this server: this one."""
        return [os.getpid()]

    def num_requests_in_handlers(self) -> int:
        """HTTP requests whose handler runs now (headers in, answer not yet complete)."""
        return len(self._server.server_state.tasks)

    def stop(self) -> int:
        """Shut down as `serve` does on SIGTERM (grace period, lifespan); 0 once the server's
        thread and the engine's have ended, 1 if one is still running."""
        self._server.should_exit = True
        self._thread.join(timeout=STOP_TIMEOUT_S)
        self._sock.close()
        _detach_log(self._log_handler)
        is_clean = not self._thread.is_alive() and not self.client.is_running
        if is_clean:  # built here, released here, as a worker releases its engine
            self.client.engine.shutdown()
        return 0 if is_clean else 1

    def __enter__(self) -> InProcessServer:
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if self.stop() != 0 and exc_type is None:
            raise RuntimeError(f"the server at {self.url} left a thread running:\n{self.log()}")


def _flag(args: tuple[str, ...], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def _configs_from_flags(model: Path | str, args: tuple[str, ...]):
    """`serve`'s configs and tokenizer from its flags, checked as `serve` checks them."""
    from nanoserve.cli.main import (
        build_parser,
        check_engine_config,
        engine_config_from_args,
        server_config_from_args,
    )
    from nanoserve.text.tokenizer import load_tokenizer

    argv = ["serve", "--model", str(model), *TEST_FLAGS, *args]
    parsed = build_parser().parse_args(argv)
    config = engine_config_from_args(parsed, str(model))
    model_dir = check_engine_config(config)
    server_config = server_config_from_args(parsed, str(model), model_dir)
    tokenizer = load_tokenizer(model_dir, chat_template=parsed.chat_template)
    return config, server_config, tokenizer, parsed.shutdown_timeout


def _bound_socket() -> socket.socket:
    from nanoserve.cli.startup import bind_socket

    return bind_socket("127.0.0.1", 0)


def _uvicorn_server(app, server_config, client, grace_s: float):
    """uvicorn as `serve` configures it (minus its logging setup: the loggers stay ours)."""
    import uvicorn

    from nanoserve.server.http_server import SHUTDOWN_FLUSH_S, GracefulServer, timed_h11_protocol

    protocol = timed_h11_protocol(server_config.header_timeout_s, server_config.send_timeout_s)
    config = uvicorn.Config(
        app,
        http=protocol,
        timeout_graceful_shutdown=grace_s + SHUTDOWN_FLUSH_S,
        lifespan="on",
        log_config=None,
        log_level="warning",
    )
    return GracefulServer(config, on_shutdown=lambda: client.begin_shutdown(grace_s))


_SERVER_LOGGERS = ("nanoserve", "uvicorn")


def _attach_log(path: Path, level: str, is_wanted) -> logging.Handler:
    handler = logging.FileHandler(path)
    handler.setLevel(level.upper())
    handler.addFilter(is_wanted)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in _SERVER_LOGGERS:
        logging.getLogger(name).addHandler(handler)
    return handler


def _detach_log(handler: logging.Handler) -> None:
    for name in _SERVER_LOGGERS:
        logging.getLogger(name).removeHandler(handler)
    handler.close()


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
