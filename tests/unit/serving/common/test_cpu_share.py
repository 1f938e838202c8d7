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
from serving.common.cpu_share import PERIOD_US, CgroupCpu, CpuShareError, enforce_replica_share

_REPLICA = """
import json, os, sys, torch
from serving.common.cpu_share import enforce_replica_share
enforced = enforce_replica_share("test")
print(json.dumps({"group": str(enforced.group), "quota_us": enforced.quota_us, "cores": enforced.cores,
                  "affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}), flush=True)
sys.stdin.read()  # alive until the test closes stdin
"""


def _replica(share: float) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen([sys.executable, "-c", _REPLICA], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
    first, first_seen = _replica(1.0)
    second, second_seen = _replica(1.0)
    fraction, fraction_seen = _replica(0.5)
    try:
        for seen in (first_seen, second_seen):
            assert seen["quota_us"] == PERIOD_US and len(seen["cores"]) == 1
            assert seen["affinity"] == seen["cores"] and seen["threads"] == 1
        assert first_seen["cores"] != second_seen["cores"]  # the least held cores: one each
        assert fraction_seen["quota_us"] == PERIOD_US // 2 and fraction_seen["cores"] is None
        assert len(fraction_seen["affinity"]) == len(os.sched_getaffinity(0))  # a fraction of a core is not pinned
        for child, seen in ((first, first_seen), (second, second_seen), (fraction, fraction_seen)):
            assert seen["group"].endswith(f"swiftserve/pid-{child.pid}")  # a group of its own
    finally:
        for child in (first, second, fraction):
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
    assert enforce_replica_share("Model") is None
    assert "SWIFTSERVE_CPU_SHARE=0.5 not enforced" in all_logs.text and "not writable" in all_logs.text


def test_without_a_share_nothing_is_enforced():
    assert constants.CPU_SHARE is None
    assert enforce_replica_share("Model") is None
