"""Start-up checks the front makes before the model loads (torch-free).

    bind_socket            the listening socket, bound first: a busy port fails in a second
    check_kv_cache_memory  a --kv-cache-memory too small for the model, from its config.json
    check_device           --device cuda on a machine or a torch without CUDA

Each raises ValueError with a message that names the setting and a value that would work.
"""

from __future__ import annotations

import ast
import errno
import importlib.util
import math
import shutil
import socket
from pathlib import Path

from nanoserve.common.config import EngineConfig, ModelConfig, resolve_auto_dtype
from nanoserve.common.cpu_features import has_native_bf16

NUM_PORTS_TO_SUGGEST_FROM = 20


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds one; ValueError if it cannot be.

    Its protocol is named (IPPROTO_TCP, not 0): the connections it accepts inherit it, and
    asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose protocol says TCP.
    With Nagle on, a response's body waited for the client's delayed ACK of its headers: every
    non-streaming answer on a kept-alive connection (the openai SDK's) came 40 ms late.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(_bind_error_message(host, port, error)) from None
    sock.set_inheritable(True)
    return sock


def _bind_error_message(host: str, port: int, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        free = _free_port_near(host, port)
        hint = f"; choose another, e.g. --port {free}" if free else "; choose another --port"
        return f"--port {port} is already in use on {host}{hint}"
    if error.errno == errno.EACCES:
        return f"--port {port} needs privileges on {host}; use a port ≥ 1024, e.g. --port 8000"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine; e.g. --host 127.0.0.1"
    return f"cannot listen on --host {host} --port {port}: {error.strerror or error}"


def _free_port_near(host: str, port: int) -> int | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in range(port + 1, min(port + 1 + NUM_PORTS_TO_SUGGEST_FROM, 65536)):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, candidate))
            except OSError:
                continue
            return candidate
    return None


def kv_block_bytes(config: EngineConfig, model_config: ModelConfig) -> int:
    """Bytes of one KV-cache block across all layers, as the worker will allocate it on CPU."""
    dtype = config.dtype
    if dtype == "auto":
        dtype = resolve_auto_dtype(model_config.torch_dtype, "cpu", has_native_bf16())
    bytes_per_value = 4 if dtype == "float32" else 2  # float16 and bfloat16 alike
    if config.kv_cache_dtype != "auto":
        bytes_per_value = 1  # fp8 (its per-layer scales are not counted: 2 floats a layer)
    per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads
    return per_token * model_config.head_dim * config.block_size * bytes_per_value


def check_kv_cache_memory(config: EngineConfig, model_config: ModelConfig) -> None:
    """A CPU KV budget must hold two blocks, and max_model_len tokens when the user chose it."""
    if config.kv_cache_memory is None or config.device.startswith("cuda"):
        return
    max_model_len = config.resolve_max_model_len(model_config)
    block_bytes = kv_block_bytes(config, model_config)
    num_blocks = config.kv_cache_memory // block_bytes
    num_blocks_needed = max(2, math.ceil(max_model_len / config.block_size))
    is_too_small = num_blocks < 2 or (
        config.max_model_len is not None and num_blocks < num_blocks_needed
    )
    if not is_too_small:
        return
    suggested_mib = math.ceil(num_blocks_needed * block_bytes / 2**20)
    raise ValueError(
        f"kv_cache_memory ({config.kv_cache_memory:,} bytes) holds {num_blocks * config.block_size}"
        f" tokens: a block of {config.block_size} tokens takes {block_bytes / 2**10:.1f} KiB for "
        f"this model, and one sequence of max_model_len ({max_model_len}) tokens needs "
        f"{num_blocks_needed} blocks; kv_cache_memory {suggested_mib}MiB would hold it"
    )


def check_device(device: str) -> None:
    """`--device cuda` needs a torch built with CUDA and an NVIDIA driver. Both are read from
    files (torch's version.py, /proc/driver/nvidia, nvidia-smi on PATH), not by importing torch,
    so that the answer takes milliseconds; the worker still checks that torch sees a GPU."""
    if not device.startswith("cuda"):
        return
    reason = cuda_missing_reason(torch_build_facts(), has_nvidia_driver())
    if reason is not None:
        raise ValueError(
            f"--device {device} was asked for, but {reason}; use --device cpu (--device auto "
            "picks CUDA when there is one)"
        )


def cuda_missing_reason(torch_build: dict[str, str | None] | None, has_driver: bool) -> str | None:
    """Why CUDA cannot run here, or None when it may (the worker has the last word).

    `torch_build` holds torch's `__version__`, `cuda` and `hip` (None: torch is not found)."""
    if torch_build is None:
        return None  # the worker reports a missing torch
    if torch_build.get("hip") or "cuda" not in torch_build:
        return None  # a ROCm build (its GPUs answer to "cuda" too), or a version.py unlike ours
    if torch_build["cuda"] is None:
        return f"this torch ({torch_build.get('__version__')}) is built without CUDA"
    if not has_driver:
        return "this machine has no NVIDIA driver (no /proc/driver/nvidia, no nvidia-smi)"
    return None


def torch_build_facts() -> dict[str, str | None] | None:
    """`__version__`, `cuda` and `hip` as the installed torch's version.py assigns them, read
    without importing torch (which takes seconds); None where torch or the file is not found."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        tree = ast.parse(version_file.read_text())
    except (OSError, SyntaxError):
        return None
    facts: dict[str, str | None] = {}
    for node in tree.body:  # `cuda: Optional[str] = None`, `__version__ = '2.13.0+cpu'`
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Constant):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            value = node.value.value
            for target in targets:
                if isinstance(target, ast.Name):
                    facts[target.id] = value if isinstance(value, str) else None
    return facts


def has_nvidia_driver() -> bool:
    """An NVIDIA kernel driver is loaded (Linux), or its command-line tool is installed."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None
