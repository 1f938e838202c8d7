"""Fixtures shared by the serving unit tests."""

import os
from collections.abc import Iterator

import pytest
import torch

from serving.common.device import pin_process


@pytest.fixture
def restore_affinity() -> Iterator[list[int]]:
    """The cores this process may use (at least two, else the test is skipped); every thread's affinity and
    torch's thread count are put back after the test."""
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if len(cores) < 2:
        pytest.skip("pinning needs a process allowed on two cores or more")
    yield cores
    pin_process(cores)
    torch.set_num_threads(threads)
