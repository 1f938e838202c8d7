"""CPU core pinning: ``cores_for`` picks a replica's cores, ``pin_thread`` / ``pin_process`` apply them;
``resolve_device`` applies a GPU share's memory cap."""

import os
import threading

import psutil
import pytest
import torch

from serving.common import constants
from serving.common.device import cores_for, free_memory_bytes, pin_process, pin_thread, resolve_device


def _start_reader(go: threading.Event | None = None) -> tuple[threading.Thread, list[set[int]]]:
    """A started thread that records its affinity (once ``go`` is set, when given)."""
    seen: list[set[int]] = []

    def read() -> None:
        if go is not None:
            go.wait(timeout=30)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=read)
    thread.start()
    return thread, seen


def _joined(thread: threading.Thread, seen: list[set[int]]) -> set[int]:
    """What the thread recorded, once it ended."""
    thread.join(timeout=30)
    assert not thread.is_alive()
    return seen[-1]


def _affinity_of_new_thread() -> set[int]:
    return _joined(*_start_reader())


def test_cores_for_takes_the_entry_of_the_rank_modulo_the_entries():
    entries = [[0], [1, 2], [3]]
    assert [cores_for(entries, rank) for rank in range(5)] == [[0], [1, 2], [3], [0], [1, 2]]
    assert cores_for([], 0) is None and cores_for([], 7) is None


def test_pin_thread_pins_the_caller_and_threads_it_starts_not_the_others(restore_affinity):
    everything, last = set(restore_affinity), restore_affinity[-1]
    seen: list[set[int]] = []

    def pinned_worker() -> None:
        pin_thread([last])
        seen.append(os.sched_getaffinity(0))
        seen.append(_affinity_of_new_thread())

    thread = threading.Thread(target=pinned_worker)
    thread.start()
    _joined(thread, seen)
    assert seen == [{last}, {last}]
    assert os.sched_getaffinity(0) == everything  # the test's own thread is untouched


def test_pin_process_pins_running_and_later_threads_with_one_torch_thread_per_core(restore_affinity):
    first, second = restore_affinity[:2]
    go = threading.Event()
    running = _start_reader(go)
    pin_process([second, first])
    go.set()
    assert _joined(*running) == {first, second}  # started before the pin
    assert os.sched_getaffinity(0) == {first, second}
    assert _affinity_of_new_thread() == {first, second}
    assert torch.get_num_threads() == 2
    pin_process([second])
    assert os.sched_getaffinity(0) == {second} and torch.get_num_threads() == 1


@pytest.mark.parametrize("cores", [[], [-1], [os.cpu_count() or 1]], ids=["none", "negative", "missing"])
@pytest.mark.parametrize("pin", [pin_thread, pin_process], ids=["thread", "process"])
def test_pinning_to_bad_cores_is_refused_and_changes_nothing(restore_affinity, pin, cores):
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match="core"):
        pin(cores)
    assert os.sched_getaffinity(0) == set(restore_affinity)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize(("requested", "current", "index"), [("cuda", 1, 1), ("auto", 0, 0), ("cuda:2", 0, 2)])
def test_a_gpu_share_caps_the_allocator_of_the_device_the_replica_uses(monkeypatch, requested, current, index):
    """torch refuses a bare ``cuda`` device here (it wants an index): the cap goes to the current device's index."""
    capped: list[tuple[float, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: capped.append((f, device)))
    monkeypatch.setattr(constants, "CUDA_MEMORY_FRACTION", 0.25)
    monkeypatch.setattr(constants, "DEVICE_OVERRIDE", "")
    assert resolve_device(requested).type == "cuda"
    assert capped == [(0.25, index)] and type(capped[0][1]) is int


@pytest.mark.parametrize(("fraction", "expected"), [(None, 30), (0.5, 20), (0.2, 0)])
def test_free_cuda_memory_stays_within_the_process_cap(monkeypatch, fraction, expected):
    """A 100 GiB device, 30 free, this process holding 30 reserved: the cap leaves 0.5 x 100 - 30 = 20, or none."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(constants, "CUDA_MEMORY_FRACTION", fraction)
    assert free_memory_bytes(torch.device("cuda", 0)) == expected * gib


def test_free_host_memory_is_what_the_host_has_available():
    assert 0 < free_memory_bytes(torch.device("cpu")) <= psutil.virtual_memory().total
