"""The front's start-up checks: a busy port before the model loads, a KV budget the worker can
use, computed without torch but equal to what the worker allocates, and CUDA where it cannot
run, read from files without importing torch."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.cli.startup import (
    bind_socket,
    check_device,
    check_kv_cache_memory,
    cuda_missing_reason,
    kv_block_bytes,
)
from nanoserve.common.checkpoint import load_model_config
from nanoserve.common.config import EngineConfig


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")


@pytest.fixture
def busy_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_busy_port_names_the_flag_and_a_free_one(busy_port: int) -> None:
    with pytest.raises(ValueError, match=rf"--port {busy_port} is already in use") as raised:
        bind_socket("127.0.0.1", busy_port)
    suggested = int(str(raised.value).rsplit("--port ", 1)[1])
    bind_socket("127.0.0.1", suggested).close()  # the suggestion works


def test_connections_to_the_bound_socket_send_without_nagles_delay() -> None:
    """asyncio (which uvicorn serves on) sets TCP_NODELAY on the connections the socket accepts,
    so a response's body does not wait for the client's delayed ACK of its headers."""
    listener = bind_socket("127.0.0.1", 0)
    accepted: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            accepted.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        while not accepted:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(accept_one(), timeout=10))
    assert accepted == [1]


def test_serve_reports_a_busy_port_before_the_model_loads(busy_port: int) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.cli.main", "serve", "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"nanoserve serve: --port {busy_port} is already in use")
    assert len(done.stderr.strip().splitlines()) == 1
    assert "worker" not in done.stderr + done.stdout
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_the_front_computes_the_workers_block_size(tiny_checkpoint: Path, dtype: str) -> None:
    from nanoserve.core.engine import Engine

    config = EngineConfig(model=str(tiny_checkpoint), dtype=dtype, device="cpu", num_kv_blocks=4)
    engine = Engine(config)
    assert kv_block_bytes(config, load_model_config(tiny_checkpoint)) == (
        engine.kv_cache.block_bytes
    )


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_the_front_counts_fp8_kv_bytes(tiny_checkpoint: Path, kv_cache_dtype: str) -> None:
    from nanoserve.engine_setup import build_engine

    config = EngineConfig(
        model=str(tiny_checkpoint), device="cpu", num_kv_blocks=4, kv_cache_dtype=kv_cache_dtype
    )
    engine = build_engine(config)
    assert kv_block_bytes(config, load_model_config(tiny_checkpoint)) == (
        engine.kv_cache.block_bytes
    )
    bf16 = EngineConfig(model=str(tiny_checkpoint), dtype="bfloat16")
    assert 2 * engine.kv_cache.block_bytes == kv_block_bytes(bf16, engine.model_config)


def test_the_suggested_kv_budget_starts_the_engine(tiny_checkpoint: Path) -> None:
    from nanoserve.core.engine import Engine

    too_small = EngineConfig(
        model=str(tiny_checkpoint), device="cpu", kv_cache_memory=2**17, max_model_len=512
    )
    model_config = load_model_config(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"kv_cache_memory \d+MiB would hold it") as raised:
        check_kv_cache_memory(too_small, model_config)
    suggested_mib = int(str(raised.value).rsplit("kv_cache_memory ", 1)[1].split("MiB")[0])
    fixed = EngineConfig(
        model=str(tiny_checkpoint), device="cpu", kv_cache_memory=suggested_mib * 2**20,
        max_model_len=512,
    )  # fmt: skip
    check_kv_cache_memory(fixed, model_config)
    kv_cache = Engine(fixed).kv_cache
    assert kv_cache.num_blocks * kv_cache.block_size >= 512


CPU_TORCH = {"__version__": "2.13.0+cpu", "cuda": None, "hip": None}
CUDA_TORCH = {"__version__": "2.13.0", "cuda": "12.8", "hip": None}
ROCM_TORCH = {"__version__": "2.13.0+rocm6.4", "cuda": None, "hip": "6.4"}


@pytest.mark.parametrize(
    ("torch_build", "has_driver", "reason"),
    [
        (CPU_TORCH, True, "this torch (2.13.0+cpu) is built without CUDA"),
        (CUDA_TORCH, False, "this machine has no NVIDIA driver"),
        (CUDA_TORCH, True, None),  # the worker then asks torch whether it sees a GPU
        (ROCM_TORCH, False, None),  # AMD GPUs answer to "cuda" without NVIDIA's driver
        (None, False, None),  # no torch found: the worker says so
        ({"__version__": "9.0"}, False, None),  # a version.py unlike today's: no guess
    ],
)
def test_why_cuda_cannot_run(torch_build, has_driver: bool, reason: str | None) -> None:
    found = cuda_missing_reason(torch_build, has_driver)
    assert found == reason or (reason is not None and found.startswith(reason)), found


def test_the_torch_build_is_read_without_importing_torch() -> None:
    script = (
        "import sys\n"
        "from nanoserve.cli.startup import torch_build_facts\n"
        "facts = torch_build_facts()\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "assert facts['__version__'] == torch.__version__, facts\n"
        "assert (facts['cuda'], facts['hip']) == (torch.version.cuda, torch.version.hip), facts\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_cpu_devices_are_never_refused() -> None:
    check_device("cpu")
    check_device("auto")  # auto is CPU where CUDA cannot run
