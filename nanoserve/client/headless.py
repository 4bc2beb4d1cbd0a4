"""`nanoserve serve --headless`: a machine that only runs ranks of an engine served elsewhere.

Node 0 runs the front and rank 0; every other node runs its share of the tensor-parallel ranks
and keeps them running: when any rank exits (the group failed, or node 0 restarted it), it kills
the rest and starts them again, so they rejoin the group's next rendezvous.
"""

from __future__ import annotations

import logging
import signal
import time

from nanoserve.client.worker_process import (
    WorkerGroup,
    WorkerProcess,
    local_ranks,
    rendezvous_address,
)
from nanoserve.common.config import EngineConfig
from nanoserve.common.protocol import WorkerAddresses

logger = logging.getLogger("nanoserve.headless")

RESTART_DELAY_S = 2.0
NO_SOCKETS = WorkerAddresses(to_worker="none", to_front="none")  # followers talk to no front


def run_headless(config: EngineConfig, log_level: str = "info") -> int:
    """Run this node's ranks until interrupted (SIGINT or SIGTERM), restarting them whenever the
    group fails; the ranks end with it."""
    if config.node_rank == 0:
        raise ValueError("node 0 runs the front: start it without --headless")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: stop the ranks first
    init_method = rendezvous_address(config)
    ranks = list(local_ranks(config))
    while True:
        processes = [WorkerProcess(config, NO_SOCKETS, log_level, r, init_method) for r in ranks]
        group = WorkerGroup(processes)
        try:
            logger.info("ranks %s of %d started", ranks, config.tensor_parallel_size)
            while group.is_alive():
                time.sleep(0.5)  # paces the watch; a rank's exit is noticed within it
            logger.warning(
                "a rank exited (code %s); restarting this node's ranks", group.returncode
            )
            group.kill()
            time.sleep(RESTART_DELAY_S)
        except KeyboardInterrupt:
            return 0
        finally:
            group.kill()
