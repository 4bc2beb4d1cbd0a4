"""DataParallelClient: N independent engines behind one front (`--data-parallel-size N`).

Each engine is a whole `ZmqEngineClient` of its own: its worker process (or tensor-parallel
group), its KV cache, its supervisor that restarts it when it dies. This client only chooses,
per request, which engine serves it (`PrefixRouter`: the engine that saw the prompt's longest
prefix, else the least loaded) and answers for the group: ready while any engine is, an
engine's crash fails only that engine's requests. Each engine's stats reach the metrics with its
index (`engine="k"`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import msgspec

from nanoserve.client.engine_client import EngineClient, EngineDeadError, EngineStartError
from nanoserve.client.prefix_router import ROUTINGS, PrefixRouter
from nanoserve.client.request_stream import RequestStream
from nanoserve.client.zmq_engine_client import ZmqEngineClient
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import DEFAULT_WORKER_TIMEOUT_S, Ready
from nanoserve.common.sampling_params import SamplingParams


class DataParallelClient(EngineClient):
    """Routes each request to one of several engines; each engine runs and recovers alone."""

    def __init__(
        self,
        config: EngineConfig,
        log_level: str = "info",
        worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
        routing: str = "prefix",
        restart_delay_s: float = 1.0,
    ) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.routing = routing
        self.engines = [
            ZmqEngineClient(
                dataclasses.replace(config, data_parallel_rank=rank),
                log_level=log_level,
                restart_delay_s=restart_delay_s,
                worker_timeout_s=worker_timeout_s,
            )
            for rank in range(config.data_parallel_size)
        ]
        self.router = PrefixRouter(len(self.engines), config.block_size)
        self._started: set[int] = set()  # engines that have been ready at least once
        self._turns = itertools.cycle(range(len(self.engines)))

    @property
    def is_ready(self) -> bool:
        """The server takes new requests: at start-up once every engine is ready (as vLLM's
        front waits for all its engines), afterwards while any engine is."""
        if not self._is_accepting:
            return False
        if len(self._started) < len(self.engines):
            return False
        return any(e.is_ready for e in self.engines)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def num_unstarted(self) -> int:
        return sum(e.num_unstarted for e in self.engines)

    @property
    def num_in_flight(self) -> int:
        return sum(e.num_in_flight for e in self.engines)

    def launch(self) -> None:
        for engine in self.engines:
            engine.launch()

    async def start(self) -> None:
        """Start every engine in the background (each loads its own copy of the model)."""
        for engine in self.engines:
            engine.on_stats = self.on_stats
            engine.on_step_tokens = self.on_step_tokens
            engine.timelines = self.timelines
            engine.on_ready = lambda info, e=engine: self._engine_ready(e, info)
            engine.on_start_failed = self._engine_failed_to_start
            await engine.start()

    def _engine_ready(self, engine: ZmqEngineClient, info: Ready) -> None:
        if self.info is None:
            self.info = info
        self._started.add(engine.engine_index)
        self.router.forget_engine(engine.engine_index)  # a new worker's cache is empty
        if self.on_ready is not None:
            self.on_ready(info)

    def _engine_failed_to_start(self, error: EngineStartError) -> None:
        """One engine could not start: the server stops, as with a single engine."""
        if self.start_error is None:
            self.start_error = error
            if self.on_start_failed is not None:
                self.on_start_failed(error)

    def choose_engine(self, prompt_token_ids: list[int], remember: bool = False) -> ZmqEngineClient:
        """The engine for this prompt; `remember`: the router records where its prefix went."""
        ready = [e.is_ready for e in self.engines]
        if not any(ready):
            raise EngineDeadError("no model worker is ready")
        if self.routing == "round-robin":
            return self.engines[next(i for i in self._turns if ready[i])]
        loads = [e.num_in_flight for e in self.engines]
        if self.routing == "least-loaded":
            return self.engines[self.router.least_loaded(loads, ready)]
        route = self.router.route if remember else self.router.choose
        return self.engines[route(prompt_token_ids, loads, ready)]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: RequestStream,
        record_timeline: bool = False,
    ) -> int:
        if not self._is_accepting:
            raise EngineDeadError("the server is shutting down")
        engine = self.choose_engine(prompt_token_ids, remember=True)
        return engine.add_request(request_id, prompt_token_ids, params, stream, record_timeline)

    def abort(self, request_ids: list[str]) -> None:
        """Each engine aborts those of the ids it serves (it knows its own)."""
        for engine in self.engines:
            engine.abort(request_ids)

    def begin_shutdown(self, grace_s: float) -> None:
        self._is_accepting = False
        for engine in self.engines:
            engine.begin_shutdown(grace_s)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        self._is_accepting = False
        await asyncio.gather(*(e.shutdown(timeout_s) for e in self.engines))

    def kill_now(self) -> None:
        for engine in self.engines:
            engine.kill_now()

    def _send(self, message: msgspec.Struct) -> bool:
        raise NotImplementedError("the engines send their own messages")


def make_engine_client(
    config: EngineConfig,
    log_level: str = "info",
    worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
    routing: str = "prefix",
) -> ZmqEngineClient | DataParallelClient:
    """One engine's client, or a data-parallel group's when `data_parallel_size` > 1."""
    if config.data_parallel_size == 1:
        return ZmqEngineClient(config, log_level=log_level, worker_timeout_s=worker_timeout_s)
    return DataParallelClient(config, log_level, worker_timeout_s, routing)
