"""CPU shares enforced by the kernel: a CFS quota in the cgroup cpu controller, whole cores pinned apart.

Enforcing moves the calling process into a limited group, so everything that enforces runs in a child process.
"""

import json
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from serving.common import constants, cpu_share
from serving.common.cpu_share import PERIOD_US, CgroupCpu, CpuShareError, enforces_replica_share

_REPLICA = """
import asyncio, json, os, sys, torch
from serving.common.cpu_share import enforces_replica_share

def state():
    return {"cgroup": open("/proc/self/cgroup").read(), "affinity": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads()}

class Replica:
    @enforces_replica_share
    def __init__(self):
        self.starting = state()

class AsyncReplica:
    @enforces_replica_share
    async def __init__(self):
        await asyncio.sleep(0)
        self.starting = state()

if sys.argv[1] == "async":  # as Serve starts a replica whose __init__ is async
    replica = AsyncReplica.__new__(AsyncReplica)
    asyncio.run(replica.__init__())
else:
    replica = Replica()
print(json.dumps({"starting": replica.starting, "started": state()}), flush=True)
sys.stdin.read()  # alive until the test closes stdin
"""


def _replica(share: float, init: str = "sync") -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen([sys.executable, "-c", _REPLICA, init], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=os.environ | {"SWIFTSERVE_CPU_SHARE": str(share)})
    line = child.stdout.readline()
    assert line, f"the child exited with {child.wait()}"
    return child, json.loads(line)


def _cpu_seconds(process: psutil.Process, window_s: float) -> float:
    before = sum(process.cpu_times()[:2])
    time.sleep(window_s)
    return sum(process.cpu_times()[:2]) - before


def test_a_busy_process_limited_to_a_quarter_share_gets_at_most_a_quarter_of_a_core_and_its_group_goes_with_it():
    cgroups = CgroupCpu.find()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        group = cgroups.limit(busy.pid, 0.25, f"test-{uuid.uuid4().hex[:8]}")
        assert cgroups.quota_us(group) == PERIOD_US // 4
        assert str(busy.pid) in (group / "cgroup.procs").read_text().split()
        assert _cpu_seconds(psutil.Process(busy.pid), 2.0) <= 2.0 * 0.25 * 1.15  # unlimited it would spin 2 s
    finally:
        busy.kill()
        busy.wait()
    deadline = time.monotonic() + 5
    while str(busy.pid) in (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel takes an exited process out of its group shortly after the wait
    cgroups.sweep()
    assert not group.exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning two replicas apart needs two cores")
def test_replicas_enforce_their_share_from_the_environment_and_whole_cores_are_pinned_apart():
    cgroups = CgroupCpu.find()
    first, first_seen = _replica(1.0)
    second, second_seen = _replica(1.0, "async")
    fraction, fraction_seen = _replica(0.5)
    try:
        for seen in (first_seen["started"], second_seen["started"]):
            assert len(seen["affinity"]) == 1 and seen["threads"] == 1
        assert first_seen["started"]["affinity"] != second_seen["started"]["affinity"]  # the least held: one each
        assert len(fraction_seen["started"]["affinity"]) == len(os.sched_getaffinity(0))  # a fraction: not pinned
        replicas = ((first, first_seen, 1.0), (second, second_seen, 1.0), (fraction, fraction_seen, 0.5))
        for child, seen, share in replicas:
            group = cgroups.base / f"pid-{child.pid}"  # a group of its own, with the share's quota
            assert f"/swiftserve/pid-{child.pid}" in seen["started"]["cgroup"]
            assert cgroups.quota_us(group) == int(share * PERIOD_US)
    finally:
        for child in (first, second, fraction):
            child.communicate("")


@pytest.mark.parametrize("init", ["sync", "async"])
def test_a_replica_starts_pinned_but_unthrottled_and_is_throttled_once_started(init):
    """Building a model at a fraction of a core only delays serving: the quota comes when ``__init__`` returns."""
    child, seen = _replica(1.0, init)
    try:
        assert "/swiftserve/" not in seen["starting"]["cgroup"]  # no quota while starting
        assert seen["starting"]["affinity"] == seen["started"]["affinity"] and len(seen["starting"]["affinity"]) == 1
        assert f"/swiftserve/pid-{child.pid}" in seen["started"]["cgroup"]
    finally:
        child.communicate("")


def test_a_node_without_a_writable_cpu_controller_is_named_and_the_replica_runs_with_the_share_reserved(
        tmp_path, monkeypatch, all_logs):
    with pytest.raises(CpuShareError, match="no cgroup cpu controller"):
        CgroupCpu.find(tmp_path)
    with pytest.raises(ValueError, match="share must be > 0"):
        CgroupCpu.find().limit(os.getpid(), 0.0, "never")
    monkeypatch.setattr(constants, "CPU_SHARE", 0.5)

    def unwritable(cls, root=None):
        raise CpuShareError("the cgroup cpu controller at /x is not writable")

    monkeypatch.setattr(cpu_share.CgroupCpu, "find", classmethod(unwritable))
    started = _Model()
    assert started.cgroup == _own_cgroup()  # started and left where it was, with the share only reserved
    assert "_Model replica: SWIFTSERVE_CPU_SHARE=0.5 not enforced" in all_logs.text
    assert "not writable" in all_logs.text


def test_without_a_share_nothing_is_enforced(monkeypatch):
    assert constants.CPU_SHARE is None

    def never(cls, root=None):
        raise AssertionError("no share: the cgroups are not even looked at")

    monkeypatch.setattr(cpu_share.CgroupCpu, "find", classmethod(never))
    assert _Model().cgroup == _own_cgroup()


class _Model:
    @enforces_replica_share
    def __init__(self) -> None:
        self.cgroup = _own_cgroup()


def _own_cgroup() -> str:
    with open("/proc/self/cgroup") as file:
        return file.read()
