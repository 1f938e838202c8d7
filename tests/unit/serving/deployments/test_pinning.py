"""``pin_replica``: a Serve replica pins itself by its rank on its node (the replica context is faked, no Ray)."""

import os
from types import SimpleNamespace

import pytest
import torch
from ray.serve.schema import ReplicaRank

from serving.deployments import pinning


def _replica(monkeypatch: pytest.MonkeyPatch, rank: ReplicaRank | None) -> None:
    monkeypatch.setattr(pinning.serve, "get_replica_context", lambda: SimpleNamespace(rank=rank))


def test_replica_is_pinned_by_its_rank_on_its_node_not_its_global_rank(monkeypatch, restore_affinity):
    first, second = restore_affinity[:2]
    _replica(monkeypatch, ReplicaRank(rank=3, node_rank=1, local_rank=1))
    pinning.pin_replica([[first], [second], [first, second]], "DiffusionModel")
    assert os.sched_getaffinity(0) == {second}  # entry 1 % 3, where the global rank would give entry 0
    assert torch.get_num_threads() == 1


def test_replica_without_a_rank_takes_the_first_entry(monkeypatch, restore_affinity):
    first, second = restore_affinity[:2]
    _replica(monkeypatch, None)
    pinning.pin_replica([[second, first], [first]], "CFG worker")
    assert os.sched_getaffinity(0) == {first, second} and torch.get_num_threads() == 2


def test_replica_without_entries_is_left_alone_and_needs_no_replica_context(restore_affinity):
    threads = torch.get_num_threads()
    pinning.pin_replica([], "DiffusionModel")  # outside Serve: reading the replica context would raise
    assert os.sched_getaffinity(0) == set(restore_affinity) and torch.get_num_threads() == threads
