"""Tensor hand-over between replicas: one object-store put per live tensor, nothing kept past its requests."""

import gc

import numpy as np
import pytest
import torch

from serving.deployments.transport import ResolvedTensors, SharedTensors
from tests.helpers.clock import ManualClock
from tests.helpers.fake_serve import FakeStore


def test_a_tensor_is_put_once_while_it_lives_and_forgotten_when_freed():
    store = FakeStore()
    shared = SharedTensors(put=store.put)
    image = torch.rand(1, 3, 8, 8)
    first = shared.ref(image)
    assert shared.ref(image) is first and store.puts == 1
    other = torch.rand(1, 3, 8, 8)
    assert shared.ref(other) is not first and store.puts == 2
    del image, other
    gc.collect()
    assert len(shared) == 0


def test_many_requests_leave_no_references_behind():
    store = FakeStore()
    shared = SharedTensors(put=store.put)
    for _ in range(500):  # each request's conditioning image, used for several steps, then dropped
        image = torch.rand(1, 3, 4, 4)
        refs = {shared.ref(image).key for _ in range(5)}
        assert len(refs) == 1
    del image
    gc.collect()
    assert len(shared) == 0 and store.puts == 500


def test_a_new_tensor_reusing_a_freed_id_gets_its_own_reference():
    store = FakeStore()
    shared = SharedTensors(put=store.put)
    keys = set()
    for value in range(50):  # freed tensors' ids are often reused at once
        tensor = torch.full((4,), float(value))
        ref = shared.ref(tensor)
        keys.add(ref.key)
        assert np.array_equal(store.objects[ref.key], tensor.numpy())
        del tensor
    assert len(keys) == 50


def test_resolved_tensors_are_fetched_once_while_in_use():
    store = FakeStore()
    ref = store.put(np.arange(16, dtype=np.float32))
    resolved = ResolvedTensors(get=store.get)
    first = resolved.get(ref)
    assert resolved.get(ref) is first and store.gets == 1
    assert torch.equal(first, torch.arange(16, dtype=torch.float32))


def test_resolved_tensors_unused_for_idle_s_are_dropped():
    store, clock = FakeStore(), ManualClock(0.0)
    resolved = ResolvedTensors(get=store.get, idle_s=10.0, clock=clock)
    old, kept = store.put(np.zeros(4, np.float32)), store.put(np.ones(4, np.float32))
    resolved.get(old)
    clock.now = 6.0
    resolved.get(kept)
    clock.now = 12.0  # old idle 12 s, kept 6 s
    resolved.get(kept)
    assert len(resolved) == 1 and resolved.nbytes == 16
    resolved.get(old)
    assert store.gets == 3  # old fetched again


@pytest.mark.parametrize("count", [1, 7, 40])
def test_resolved_tensors_stay_within_their_byte_budget(count):
    store = FakeStore()
    resolved = ResolvedTensors(get=store.get, max_bytes=10 * 64)
    refs = [store.put(np.full(16, i, np.float32)) for i in range(count)]  # 64 bytes each
    for ref in refs:
        resolved.get(ref)
    assert len(resolved) == min(count, 10) and resolved.nbytes == 64 * min(count, 10)
    assert float(resolved.get(refs[-1])[0]) == count - 1  # the most recent is kept
    assert store.gets == count


def test_a_tensor_over_the_whole_budget_is_still_served():
    store = FakeStore()
    resolved = ResolvedTensors(get=store.get, max_bytes=8)
    small, big = store.put(np.zeros(1, np.float32)), store.put(np.zeros(64, np.float32))
    resolved.get(small)
    assert resolved.get(big).shape == (64,)
    assert len(resolved) == 1 and resolved.nbytes == 256


def test_context_rows_travel_as_one_reference_per_tensor_and_resolve_back():
    store, sent = FakeStore(), []
    shared = SharedTensors(put=store.put, sent=sent.append)
    first, second = torch.rand(2, 3, 4), torch.rand(1, 3, 4)
    wire = shared.rows([(first, 1), (second, 0), (first, 0)])
    assert store.puts == 2 and sent == [first.nbytes, second.nbytes]
    assert wire[0][0] is wire[2][0] and [row for _, row in wire] == [1, 0, 0]
    resolved = ResolvedTensors(get=store.get).rows(wire)
    assert store.gets == 2 and resolved[0][0] is resolved[2][0]
    assert all(torch.equal(tensor[row], original[index]) for (tensor, row), (original, index)
               in zip(resolved, [(first, 1), (second, 0), (first, 0)], strict=True))
