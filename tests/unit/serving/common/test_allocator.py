"""The malloc settings replicas start with: that glibc keeps freed memory under them, and the start-up check.

glibc reads its settings at process start, so the allocator itself is measured in child processes.
"""

import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from serving.common import allocator
from serving.common.allocator import (
    TUNED_MALLOC_ENV,
    checks_allocator,
    start_environment,
    untuned_settings,
)

_REALLOCATE = """
import json, resource, torch
floats = 16 * 2**20  # 64 MiB, above glibc's largest dynamic mmap threshold
for _ in range(16):  # made, touched and freed, as each request's activations are, until the heap holds them
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(floats).fill_(1.0)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "pages": floats * 4 // resource.getpagesize()}))
"""


def _faults_of_a_steady_allocation(settings: dict[str, str]) -> dict[str, int]:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")} | settings
    done = subprocess.run([sys.executable, "-c", _REALLOCATE], env=environment, capture_output=True, text=True,
                          check=True, timeout=120)
    return json.loads(done.stdout)


def test_under_the_tuned_settings_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    default, tuned = _faults_of_a_steady_allocation({}), _faults_of_a_steady_allocation(TUNED_MALLOC_ENV)
    assert default["faults"] > default["pages"] / 2, default  # glibc's defaults give the block back to the OS
    assert tuned["faults"] < tuned["pages"] / 100, tuned


_FREE_THEN_RELEASE = """
import json, os
from serving.common.allocator import release_freed_memory
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
blocks = [bytearray(2**20) for _ in range(256)]  # 256 MiB of heap blocks, touched (zeroed)
kept = bytearray(2**20)  # allocated above them: the freed blocks are not the top of the heap
del blocks
freed = resident_mib()
print(json.dumps({"freed": freed, "released": release_freed_memory(), "after": resident_mib()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_under_the_tuned_settings_freed_blocks_stay_resident_until_released():
    environment = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", _FREE_THEN_RELEASE], env=environment | TUNED_MALLOC_ENV,
                          capture_output=True, text=True, check=True, timeout=120)
    resident = json.loads(done.stdout)
    assert resident["released"] is True
    assert resident["freed"] - resident["after"] > 200, resident  # of the 256 MiB freed, nearly all handed back


def _environ_file(tmp_path: Path, entries: dict[str, str]) -> Path:
    path = tmp_path / "environ"
    path.write_bytes(b"".join(f"{name}={value}".encode() + b"\0" for name, value in entries.items()))
    return path


def test_the_start_environment_is_read_from_the_processs_environ_file(tmp_path):
    entries = {"PATH": "/usr/bin", "OPTIONS": "a=b=c", "EMPTY": ""}
    assert start_environment(_environ_file(tmp_path, entries)) == entries
    assert start_environment(tmp_path / "absent") is None
    assert start_environment(Path(f"/proc/{os.getpid()}/environ")) == start_environment()


def test_untuned_settings_names_each_missing_or_different_setting_with_its_tuned_value():
    assert untuned_settings(dict(TUNED_MALLOC_ENV)) == {}
    different = dict(TUNED_MALLOC_ENV, MALLOC_MMAP_MAX_="65536")
    del different["MALLOC_ARENA_MAX"]
    assert untuned_settings(different) == {name: TUNED_MALLOC_ENV[name]
                                           for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_")}


class _Replica:
    @checks_allocator
    def __init__(self, value: int) -> None:
        self.value = value


class _AsyncReplica:
    @checks_allocator
    async def __init__(self, value: int) -> None:
        self.value = value


def _start(replica_class: type, value: int) -> object:
    replica = replica_class.__new__(replica_class)
    started = replica.__init__(value)
    if asyncio.iscoroutine(started):
        asyncio.run(started)
    return replica


@pytest.mark.parametrize("replica_class", [_Replica, _AsyncReplica])
def test_a_replica_started_without_the_settings_warns_naming_them_and_still_starts(replica_class, tmp_path,
                                                                                      monkeypatch, caplog):
    monkeypatch.setattr(allocator, "_START_ENVIRON", _environ_file(tmp_path, {"MALLOC_ARENA_MAX": "1"}))
    with caplog.at_level(logging.WARNING, logger="serving.common.allocator"):
        assert _start(replica_class, 3).value == 3
    (record,) = caplog.records
    assert replica_class.__name__ in record.getMessage()
    assert all(f"{name}={TUNED_MALLOC_ENV[name]}" in record.getMessage()
               for name in set(TUNED_MALLOC_ENV) - {"MALLOC_ARENA_MAX"})
    assert "MALLOC_ARENA_MAX" not in record.getMessage()


@pytest.mark.parametrize("replica_class", [_Replica, _AsyncReplica])
def test_a_replica_started_with_the_settings_says_nothing(replica_class, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(allocator, "_START_ENVIRON", _environ_file(tmp_path, TUNED_MALLOC_ENV))
    with caplog.at_level(logging.WARNING, logger="serving.common.allocator"):
        assert _start(replica_class, 4).value == 4
    assert caplog.records == []


@pytest.mark.parametrize("replica_class", [_Replica, _AsyncReplica])
def test_a_replica_hands_its_freed_memory_back_once_its_init_returns(replica_class, monkeypatch):
    events = []

    def release(deployment: str | None = None) -> bool:
        events.append(("release", deployment, getattr(replica, "value", None)))
        return True

    monkeypatch.setattr(allocator, "release_freed_memory", release)
    replica = replica_class.__new__(replica_class)
    started = replica.__init__(5)
    if asyncio.iscoroutine(started):
        asyncio.run(started)
    assert events == [("release", replica_class.__name__, 5)]  # after __init__ set the value, named, once
