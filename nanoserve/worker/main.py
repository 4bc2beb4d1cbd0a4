"""The worker process: load the engine, say Ready, then run the engine loop until told to stop.

Started by the front as `python -m nanoserve.worker.main ...` (a fresh interpreter: no fork of
a process holding threads, sockets or CUDA state; `client/worker_process.py` builds the command).
Rank 0 talks to the front over ZMQ; every other tensor-parallel rank only follows rank 0's steps.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

import msgspec

from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    Ready,
    WorkerAddresses,
    WorkerFailed,
)
from nanoserve.worker.heartbeat import HeartbeatThread
from nanoserve.worker.loop import ready_message, serve_engine
from nanoserve.worker.ranks import RankPlacement, make_engine, run_follower
from nanoserve.worker.transport import WorkerSockets

if TYPE_CHECKING:
    from nanoserve.core.engine import Engine

logger = logging.getLogger("nanoserve.worker")


def run_worker(
    config: EngineConfig,
    addresses: WorkerAddresses,
    parent_pid: int,
    placement: RankPlacement | None = None,
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
) -> int:
    """Body of the worker process (rank 0 of its engine); returns its exit code."""
    ignore_ctrl_c()
    sockets = WorkerSockets(addresses)
    heartbeat = HeartbeatThread(sockets.context, addresses.to_front, heartbeat_interval_s)
    engine = None
    try:
        engine, ready = build_and_warm_up(config, placement or RankPlacement())
        sockets.send(ready)
        heartbeat.start()
        # A front that died without saying Shutdown leaves this process to a new parent.
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
            engine.shutdown()  # other ranks stop following; grammar threads end
        sockets.close()


def ignore_ctrl_c() -> None:
    """Ctrl-C is the front's to handle: it stops (or kills) this process. A handler that does
    nothing, not SIG_IGN, which the processes this one starts would inherit: a compiler building
    the CPU kernels still stops at a Ctrl-C in the terminal."""
    signal.signal(signal.SIGINT, lambda signum, frame: None)


def build_and_warm_up(config: EngineConfig, placement: RankPlacement) -> tuple[Engine, Ready]:
    """The engine, built and warmed up, and its Ready message; each stage is logged as it
    starts (the engine logs its own: weights, layers, KV cache) and timed for the front."""
    started = time.perf_counter()
    logger.info("importing torch and the engine")
    import nanoserve.engine_setup  # noqa: F401  (torch, the core and the plug-ins: seconds)

    imports_s = time.perf_counter() - started
    logger.info("imports took %.2f s; choosing the fast paths, then loading the model", imports_s)
    engine = make_engine(config, placement)
    engine_s = engine.load_time_s + engine.prepare_time_s + engine.kv_sizing_time_s
    setup_s = time.perf_counter() - started - imports_s - engine_s
    logger.info("KV cache and step runners took %.2f s; warming up", engine.kv_sizing_time_s)
    warm_up_started = time.perf_counter()
    engine.warm_up()
    warmup_s = time.perf_counter() - warm_up_started
    return engine, ready_message(engine, warmup_s, imports_time_s=imports_s, setup_time_s=setup_s)


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
