"""The worker process: load the engine, say Ready, then drain → step → send until told to stop.

Run by the front as `python -m nanoserve.worker.process ...` (a fresh interpreter: no fork of a
process holding threads, sockets or CUDA state). `serve_engine` is the loop itself, written
against any receive/send pair so that tests can drive it without sockets.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import msgspec

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import (
    AbortRequests,
    AddRequest,
    Ready,
    RequestFailed,
    Shutdown,
    StepOutputs,
    WorkerFailed,
)
from nanoserve.worker.heartbeat import HeartbeatThread
from nanoserve.worker.ranks import (
    RankPlacement,
    WorkerGroup,
    local_ranks,
    make_engine,
    rendezvous_address,
    run_follower,
)
from nanoserve.worker.transport import WorkerAddresses, WorkerSockets

logger = logging.getLogger("nanoserve.worker")

IDLE_POLL_S = 0.5  # how long an idle worker blocks on its socket before checking its parent
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
WORKER_KERNEL_CACHE_SIZE = 128  # compiled oneDNN primitives kept per cache (CPU)
# Up to this many cores the worker computes on all of them: leaving one to the front would cost
# 1/cores of the compute, and on 2 cores that measured worse at every load (RESULTS.md).
ALL_CORES_UP_TO = 4


def serve_engine(
    engine,
    recv: Callable[[float], object],
    send: Callable[[msgspec.Struct], None],
    should_exit: Callable[[], bool] = lambda: False,
) -> None:
    """The worker loop. Blocks on `recv` only when the engine has nothing to run.

    After a batch of messages changed something (a new request, an abort) the engine's stats
    are sent even when no step runs, so the front sees freed KV blocks at once.
    """
    while not should_exit():
        is_idle = not engine.has_unfinished_requests()
        is_changed = False
        while True:
            message = recv(IDLE_POLL_S if is_idle and not is_changed else 0)
            if message is None:
                if is_idle and not is_changed and not should_exit():
                    continue  # nothing to do: keep waiting
                break
            if isinstance(message, Shutdown):
                return
            _handle(engine, message, send)
            is_changed = True
        if engine.has_unfinished_requests():
            deltas = engine.step()
            send(StepOutputs(deltas=deltas, stats=engine.stats()))
        elif is_changed:
            send(StepOutputs(deltas=[], stats=engine.stats()))


def _handle(engine, message, send: Callable[[msgspec.Struct], None]) -> None:
    if isinstance(message, AddRequest):
        try:
            engine.add_request(
                message.request_id, message.prompt_token_ids, message.params, message.arrival_time
            )
        except ValueError as e:  # the engine refused this request; the worker is fine
            send(RequestFailed(request_id=message.request_id, message=str(e)))
    elif isinstance(message, AbortRequests):
        engine.abort(message.request_ids)
    else:
        raise TypeError(f"unexpected message for the worker: {type(message).__name__}")


def worker_environment(num_local_ranks: int = 1) -> dict[str, str]:
    """The worker's environment: the front's, with compute threads chosen for this machine.

    - Threads: unless OMP_NUM_THREADS says otherwise the worker computes on every core of a
      small machine (up to ALL_CORES_UP_TO), where a core left idle for the front costs more
      than the front's few milliseconds per step, and on `cores - 1` of a larger one, so the
      front and its HTTP clients keep a core. Ranks of one engine share them.
    - OpenMP keeps its default wait policy (spin briefly between parallel regions, then sleep):
      passive waiting pays a thread wake-up on every op.
    - PyTorch's CPU allocator backs tensors of 2 MB and more with transparent huge pages
      (THP_MEM_ALLOC_ENABLE=1 unless set): decoding streams every weight once per token, and
      with 4 KB pages each 4 KB costs a TLB miss.
    - oneDNN's caches of compiled matmul primitives hold WORKER_KERNEL_CACHE_SIZE entries each
      (LRU_CACHE_CAPACITY: PyTorch's ideep op cache; ONEDNN_PRIMITIVE_CACHE_CAPACITY), not their
      default 1,024: every new token count of a step compiles a primitive, and a long mixed load
      kept growing the worker's memory until the caches were full.

    What each choice measured is in benchmarks/RESULTS.md.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(worker_threads(os.cpu_count() or 1, num_local_ranks)))
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        env.setdefault(name, str(WORKER_KERNEL_CACHE_SIZE))
    return env


def worker_threads(num_cores: int, num_local_ranks: int = 1) -> int:
    """Compute threads per rank: every core of a small machine, all but one of a larger one."""
    reserved_for_front = 0 if num_cores <= ALL_CORES_UP_TO else 1
    return max(1, (num_cores - reserved_for_front) // num_local_ranks)


def run_worker(
    config: EngineConfig,
    addresses: WorkerAddresses,
    parent_pid: int,
    placement: RankPlacement | None = None,
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
) -> int:
    """Body of the worker process (rank 0 of its engine); returns its exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's to handle
    sockets = WorkerSockets(addresses)
    heartbeat = HeartbeatThread(sockets.context, addresses.to_front, heartbeat_interval_s)
    engine = None
    try:
        engine = make_engine(config, placement or RankPlacement())
        started = time.perf_counter()
        engine.warm_up()
        stats = engine.stats()
        sockets.send(
            Ready(
                pid=os.getpid(),
                max_model_len=engine.max_model_len,
                vocab_size=engine.vocab_size,
                num_kv_blocks=stats.num_kv_blocks,
                block_size=stats.block_size,
                load_time_s=engine.load_time_s,
                kv_sizing_time_s=engine.kv_sizing_time_s,
                warmup_time_s=time.perf_counter() - started,
            )
        )
        heartbeat.start()
        serve_engine(engine, sockets.recv, sockets.send, lambda: os.getppid() != parent_pid)
        return 0
    except ValueError as e:  # a setting or checkpoint the engine refused: the front says why
        sockets.send(WorkerFailed(message=str(e), traceback="", is_config_error=True))
        return 1
    except Exception as e:
        logger.exception("worker failed")
        message = f"{type(e).__name__}: {e}"
        sockets.send(WorkerFailed(message=message, traceback=traceback.format_exc()))
        return 1
    finally:
        heartbeat.stop()
        if engine is not None:
            engine.runner.stop_followers()
        sockets.close()


class WorkerProcess:
    """The front's handle on one worker process."""

    def __init__(
        self,
        config: EngineConfig,
        addresses: WorkerAddresses,
        log_level: str = "info",
        placement: RankPlacement | None = None,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    ) -> None:
        placement = placement or RankPlacement()
        command = [
            sys.executable,
            "-m",
            "nanoserve.worker.process",
            "--to-worker",
            addresses.to_worker,
            "--to-front",
            addresses.to_front,
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            log_level,
            "--heartbeat-interval",
            str(heartbeat_interval_s),
            "--config",
            msgspec.json.encode(config).decode(),
            "--rank",
            str(placement.rank),
            "--dist-init",
            placement.init_method or "",
        ]
        # Every rank of every data-parallel engine on this machine shares its cores.
        num_processes = len(local_ranks(config)) * config.data_parallel_size
        env = worker_environment(num_local_ranks=num_processes)
        self._popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Wait up to `timeout_s` for the worker to exit (after Shutdown), then kill it."""
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("worker %d did not exit in %.1f s; killing it", self.pid, timeout_s)
            self._popen.kill()
            self._popen.wait()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()
        self._popen.wait()


def start_worker_group(
    config: EngineConfig,
    addresses: WorkerAddresses,
    log_level: str = "info",
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
) -> WorkerGroup:
    """Start this machine's ranks of one engine (rank 0 among them talks to the front)."""
    init_method = rendezvous_address(config)
    return WorkerGroup(
        [
            WorkerProcess(
                config,
                addresses,
                log_level,
                RankPlacement(rank, init_method),
                heartbeat_interval_s,
            )
            for rank in local_ranks(config)
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="nanoserve model worker (started by the front)")
    parser.add_argument("--to-worker", required=True)
    parser.add_argument("--to-front", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL_S)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--rank", type=int, default=0, help="tensor-parallel rank")
    parser.add_argument("--dist-init", default="", help="the group's rendezvous (tcp://...)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s worker: %(message)s"
    )
    config = msgspec.json.decode(args.config, type=EngineConfig)
    placement = RankPlacement(args.rank, args.dist_init or None)
    if args.rank != 0:
        return run_follower(config, placement, args.parent_pid)
    addresses = WorkerAddresses(args.to_worker, args.to_front)
    return run_worker(config, addresses, args.parent_pid, placement, args.heartbeat_interval)


if __name__ == "__main__":
    sys.exit(main())
