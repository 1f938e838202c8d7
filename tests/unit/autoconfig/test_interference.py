"""What a measurement lost to other work: the arithmetic over two samples, and which live processes count as the
measured system (this process's descendants, the Ray daemons' descendants) and which as foreign."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

import autoconfig.interference as interference
from autoconfig.interference import CpuSample, Interference, between, sample, system_processes

BURN = """
import sys, time
start = time.process_time()
while time.process_time() - start < float(sys.argv[1]):
    pass
"""
#: Burns once told to on its stdin, says when done, then waits for its stdin to close.
BURN_ON_CUE = """
import sys, time
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < float(sys.argv[1]):
    pass
print("done", flush=True)
sys.stdin.read()
"""


def test_the_window_charges_the_system_its_processes_time_and_the_rest_to_other_work():
    """Over 10 CPU seconds, 6 busy and 1 stolen: the system's processes used 2 (pid 1), 0 (pid 2) and 1 (pid 4,
    born in the window); pid 3 ended and pid 3 again is a new process (0.4): 3.4 are the system's, 2.6 foreign."""
    before = CpuSample(total_s=10.0, steal_s=0.5, busy_s=2.0,
                       processes={(1, 0.0): 1.0, (2, 0.0): 2.0, (3, 5.0): 0.5})
    after = CpuSample(total_s=20.0, steal_s=1.5, busy_s=8.0,
                      processes={(1, 0.0): 3.0, (2, 0.0): 2.0, (3, 7.0): 0.4, (4, 9.0): 1.0})
    lost = between(before, after)
    assert lost.steal == pytest.approx(0.1) and lost.foreign == pytest.approx(0.26)
    assert lost.lost == pytest.approx(0.36)
    assert lost.describe() == "36% of the CPUs busy elsewhere (steal 10%, other processes 26%)"


def test_a_system_busier_than_the_node_leaves_no_foreign_time_and_an_empty_window_no_measure():
    """A reaped child's whole life lands in its parent's time at once: more than the window's busy time."""
    before = CpuSample(total_s=10.0, steal_s=0.0, busy_s=2.0, processes={(1, 0.0): 1.0})
    after = CpuSample(total_s=12.0, steal_s=0.0, busy_s=3.0, processes={(1, 0.0): 9.0})
    assert between(before, after) == Interference(steal=0.0, foreign=0.0)
    assert between(before, before) is None


def _orphan(*args: str) -> int:
    """Starts ``args`` as an orphan (its parent exits at once, so init adopts it): not this process's descendant.
    Returns its pid."""
    launcher = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen(sys.argv[1:]).pid)", *args],
        capture_output=True, text=True, check=True)
    return int(launcher.stdout)


def _wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


def test_a_child_of_this_process_is_the_systems_and_its_cpu_time_is_counted():
    child = subprocess.Popen([sys.executable, "-c", BURN_ON_CUE, "0.4"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        key = (child.pid, psutil.Process(child.pid).create_time())
        before = sample()
        assert key in before.processes
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        after = sample()
        assert after.processes[key] - before.processes[key] >= 0.35
    finally:
        child.communicate("")


def test_cpu_time_of_a_process_outside_the_system_is_foreign():
    """An orphan that burns 0.5 CPU seconds and ends inside the window: at least that much is foreign (anything
    else the node runs meanwhile only adds)."""
    before = sample()
    pid = _orphan(sys.executable, "-c", BURN, "0.5")
    assert pid not in {process.pid for process in system_processes()}
    _wait_gone(pid)
    after = sample()
    lost = between(before, after)
    assert lost.foreign * (after.total_s - before.total_s) >= 0.4


def test_the_descendants_of_a_ray_daemon_belong_to_the_system(monkeypatch):
    """A cluster started by ``ray start`` is no descendant of the profiler: its daemons, found by name, bring it in."""
    pid = _orphan("sleep", "30")
    try:
        assert pid not in {process.pid for process in system_processes()}
        monkeypatch.setattr(interference, "RAY_DAEMONS", frozenset({"sleep"}))
        assert pid in {process.pid for process in system_processes()}
    finally:
        psutil.Process(pid).kill()
