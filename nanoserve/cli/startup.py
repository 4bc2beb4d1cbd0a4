"""Start-up checks the front makes before the model loads (torch-free).

    bind_socket            the listening socket, bound first: a busy port fails in a second
    check_kv_cache_memory  a --kv-cache-memory too small for the model, from its config.json

Each raises ValueError with a message that names the setting and a value that would work.
"""

from __future__ import annotations

import errno
import math
import socket

from nanoserve.common.config import EngineConfig, ModelConfig, resolve_auto_dtype
from nanoserve.common.cpu_features import has_native_bf16

NUM_PORTS_TO_SUGGEST_FROM = 20


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds one; ValueError if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
