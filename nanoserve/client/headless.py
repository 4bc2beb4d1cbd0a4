"""`nanoserve serve --headless`: a machine that only runs ranks of an engine served elsewhere.

Node 0 runs the front and rank 0; every other node runs its share of the tensor-parallel ranks
and keeps them running: when any rank exits (the group failed, or node 0 restarted it), it kills
the rest and starts them again, so they rejoin the group's next rendezvous.
"""

from __future__ import annotations

import logging
import time

from nanoserve.common.config import EngineConfig
from nanoserve.worker.process import WorkerProcess
from nanoserve.worker.ranks import RankPlacement, WorkerGroup, local_ranks, rendezvous_address
from nanoserve.worker.transport import WorkerAddresses

logger = logging.getLogger("nanoserve.headless")

RESTART_DELAY_S = 2.0
NO_SOCKETS = WorkerAddresses(to_worker="none", to_front="none")  # followers talk to no front


def run_headless(config: EngineConfig, log_level: str = "info") -> int:
    """Run this node's ranks until interrupted, restarting them whenever the group fails."""
    if config.node_rank == 0:
        raise ValueError("node 0 runs the front: start it without --headless")
    init_method = rendezvous_address(config)
    try:
        while True:
            group = WorkerGroup(
                [
                    WorkerProcess(config, NO_SOCKETS, log_level, RankPlacement(rank, init_method))
                    for rank in local_ranks(config)
                ]
            )
            logger.info("ranks %s of %d started", list(local_ranks(config)),
                        config.tensor_parallel_size)  # fmt: skip
            while group.is_alive():
                time.sleep(0.5)
            logger.warning("a rank exited (code %s); restarting this node's ranks",
                           group.returncode)  # fmt: skip
            group.kill()
            time.sleep(RESTART_DELAY_S)
    except KeyboardInterrupt:
        group.kill()
        return 0
