"""A real worker process (`python -m nanoserve.worker.main`) over ZMQ: Ready, a generation,
and a clean exit on Shutdown."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.client.transport import FrontSockets, IpcDirectory
from nanoserve.client.worker_process import WorkerProcess
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import AddRequest, FinishReason, Ready, Shutdown, StepOutputs
from nanoserve.common.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")


@pytest.mark.slow
def test_worker_process_serves_over_zmq_and_exits_on_shutdown(tiny_model: Path) -> None:
    async def scenario() -> None:
        ipc = IpcDirectory()
        addresses = ipc.addresses(1)
        sockets = FrontSockets(addresses)
        config = EngineConfig(model=str(tiny_model), num_kv_blocks=16)
        worker = WorkerProcess(config, addresses, log_level="warning")
        try:
            ready = None
            deadline = time.monotonic() + 120
            while ready is None and time.monotonic() < deadline:
                ready = await sockets.recv(1.0)
            assert isinstance(ready, Ready) and ready.pid == worker.pid
            command = Path(f"/proc/{worker.pid}/cmdline").read_bytes().split(b"\0")
            assert command[1:3] == [b"-m", b"nanoserve.worker.main"]
            assert (ready.num_kv_blocks, ready.block_size, ready.vocab_size) == (16, 16, 320)
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            assert sockets.send(AddRequest("r", [1, 2, 3], params, time.monotonic()))
            tokens, finish = [], None
            while finish is None:
                message = await sockets.recv(10.0)
                assert isinstance(message, StepOutputs)
                for delta in message.deltas:
                    tokens += delta.new_token_ids
                    finish = delta.finish_reason
            assert len(tokens) == 4 and finish == FinishReason.LENGTH
            assert sockets.send(Shutdown())
            worker.stop(timeout_s=10)
            assert worker.returncode == 0
        finally:
            worker.kill()
            sockets.close()
            ipc.cleanup()
        assert not ipc.path.exists()

    asyncio.run(scenario())
