"""How much of the node a measurement did not have: CPU time the hypervisor stole, and CPU time processes outside
the measured system used, each as a fraction of the node's CPU time over the measured window.

The measured system is this process and its descendants (a local Ray cluster's processes among them) with the
descendants of the node's Ray daemons (a cluster started by ``ray start``). A process of the system that ends
inside the window counts as foreign unless a process of the system reaps it, so measure windows where the system's
processes live throughout (a trial's rate search, not its deploy). Steal is 0 where the kernel reports none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
from pydantic import BaseModel, ConfigDict, Field

#: Ray's per-node daemons: their descendants (workers, Serve replicas and proxies) belong to the measured system.
RAY_DAEMONS = frozenset({"raylet", "gcs_server"})
#: The share of the node's CPU time lost to other work above which a measurement is flagged.
NOTICEABLE = 0.05
#: What reading the node's or a process's CPU times can raise (no /proc, a platform psutil does not support).
_UNREADABLE = (psutil.Error, OSError, NotImplementedError)


class Interference(BaseModel):
    """The node's CPU time a measurement lost, as fractions of all of it over the window."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steal: float = Field(ge=0.0, le=1.0, description="Taken by the hypervisor (the node is a virtual machine).")
    foreign: float = Field(ge=0.0, le=1.0, description="Used by processes outside the measured system.")

    @property
    def lost(self) -> float:
        return min(1.0, self.steal + self.foreign)

    def describe(self) -> str:
        return (f"{self.lost:.0%} of the CPUs busy elsewhere (steal {self.steal:.0%}, "
                f"other processes {self.foreign:.0%})")


@dataclass(frozen=True)
class CpuSample:
    """The node's CPU seconds (all CPUs: in every state, stolen, busy) and each measured-system process's CPU
    seconds, keyed by (pid, creation time) so that a reused pid is another process."""

    total_s: float
    steal_s: float
    busy_s: float
    processes: dict[tuple[int, float], float]


def system_processes() -> list[psutil.Process]:
    """This process, the node's Ray daemons and all their descendants, each once."""
    roots = [psutil.Process()]
    for process in psutil.process_iter(["name"]):
        if process.info["name"] in RAY_DAEMONS:
            roots.append(process)
    found: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for process in (root, *root.children(recursive=True)):
                found.setdefault(process.pid, process)
        except psutil.Error:  # ended while being listed
            continue
    return list(found.values())


def _process_seconds(process: psutil.Process) -> float:
    """CPU seconds of ``process`` and of its children it has reaped (their time is no longer anywhere else)."""
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def sample() -> CpuSample:
    """The node's and the measured system's CPU time now."""
    node = psutil.cpu_times()
    steal = getattr(node, "steal", 0.0)
    busy = node.user + node.nice + node.system + getattr(node, "irq", 0.0) + getattr(node, "softirq", 0.0)
    idle = node.idle + getattr(node, "iowait", 0.0)
    processes = {}
    for process in system_processes():
        try:
            processes[(process.pid, process.create_time())] = _process_seconds(process)
        except psutil.Error:  # ended since it was listed
            continue
    return CpuSample(total_s=busy + idle + steal, steal_s=steal, busy_s=busy, processes=processes)


def between(before: CpuSample, after: CpuSample) -> Interference | None:
    """What the window from ``before`` to ``after`` lost; None when no CPU time passed."""
    total = after.total_s - before.total_s
    if total <= 0:
        return None
    own = sum(seconds - before.processes.get(key, 0.0) for key, seconds in after.processes.items())
    foreign = max(0.0, (after.busy_s - before.busy_s) - own)
    steal = max(0.0, after.steal_s - before.steal_s)
    return Interference(steal=min(1.0, steal / total), foreign=min(1.0, foreign / total))


@dataclass
class InterferenceMeter:
    """Holds the interference of a ``measure_interference`` window once it closes (None before, or where the
    node's CPU times cannot be read)."""

    result: Interference | None = None


@contextmanager
def measure_interference() -> Iterator[InterferenceMeter]:
    """Measures the interference over the ``with`` block; a failure to read the CPU times leaves None."""
    meter = InterferenceMeter()
    try:
        before = sample()
    except _UNREADABLE:
        before = None
    yield meter
    if before is not None:
        try:
            meter.result = between(before, sample())
        except _UNREADABLE:
            meter.result = None
