"""Pins a Serve replica to its ``DeviceMap`` cores, before it builds its model."""

from __future__ import annotations

from collections.abc import Sequence

from ray import serve

from serving.common.device import cores_for, pin_process, placement
from serving.common.logging import get_logger

logger = get_logger("deployments.pinning")


def pin_replica(entries: Sequence[Sequence[int]], deployment: str) -> None:
    """Pins every thread of this replica to the entry of its rank on its node, one torch thread per core;
    nothing without entries. Raises ValueError for cores the machine lacks (the replica fails to start)."""
    if not entries:  # not pinned: the replica context is read only to pin, so the class also runs outside Serve
        return
    rank = serve.get_replica_context().rank
    local_rank = rank.local_rank if rank is not None else 0  # None: Serve gave the replica no rank
    cores = cores_for(entries, local_rank)
    pin_process(cores)
    logger.info("%s replica (rank %d on its node) pinned to cores %s with %d torch threads on %s",
                deployment, local_rank, cores, len(cores), placement())
