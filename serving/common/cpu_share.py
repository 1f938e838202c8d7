"""A CPU share enforced on a process: a CFS quota in the cgroup cpu controller, and whole cores by affinity.

``device_share`` on CPU is otherwise a Ray ``num_cpus`` reservation, which limits nothing. A share ``s`` puts
the process (every thread) in its own cgroup ``swiftserve/<name>`` whose quota is ``s`` CPU periods per
period (the counterpart of a pod's CPU limit, or of an MPS percentage on a GPU); from ``s >= 1`` the process is
also pinned to ``ceil(s)`` cores, the ones the other swiftserve processes of the node use least. Works on cgroup
v1 (``/sys/fs/cgroup/cpu``) and v2 (``/sys/fs/cgroup`` with the cpu controller), as root or in a delegated
cgroup; ``CpuShareError`` says why not otherwise.

A replica (``enforces_replica_share`` on its ``__init__``) is pinned before its start and throttled once started:
building a model at a tenth of a core would take ten times as long and only delay serving, so the start gets a
boost (as Kubernetes' startup CPU boost gives a pod) and every request is served within the share.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from serving.common import constants
from serving.common.device import pin_process
from serving.common.logging import get_logger
from serving.common.replica_init import Init, around_init

logger = get_logger("serving.common.cpu_share")

#: CFS period of the groups made here (the kernel's default).
PERIOD_US = 100_000
_GROUP = "swiftserve"
#: Which live process holds which cores, and the lock guarding it (cgroup directories hold no files of ours).
CLAIMS_DIR = Path(tempfile.gettempdir()) / "swiftserve-cpu"


class CpuShareError(RuntimeError):
    """The share cannot be enforced here (no writable cpu controller); the message says what is missing."""


@dataclass(frozen=True)
class EnforcedShare:
    """What a replica's share enforced: the cgroup, its quota per period, and the pinned cores (None: not pinned)."""

    group: Path
    quota_us: int
    cores: tuple[int, ...] | None

    def describe(self) -> str:
        pinned = "" if self.cores is None else f", cores {','.join(map(str, self.cores))}"
        return f"CPU share {self.quota_us / PERIOD_US:g} enforced ({self.group}{pinned})"


class CgroupCpu:
    """Where this node's cpu controller lets us make child groups; ``find`` checks it is there and writable."""

    def __init__(self, base: Path, version: int) -> None:
        self.base = base / _GROUP
        self.version = version

    @classmethod
    def find(cls, root: Path = Path("/sys/fs/cgroup")) -> CgroupCpu:
        """The cpu controller under ``root`` (v1 ``root/cpu``, else v2 ``root`` or ``root/unified`` with ``cpu`` in
        its controllers); ``CpuShareError`` when there is none or it is not writable."""
        candidates = [(root / "cpu", 1)] + [(path, 2) for path in (root, root / "unified")]
        for base, version in candidates:
            if version == 1 and (base / "cpu.cfs_quota_us").is_file():
                break
            if version == 2 and "cpu" in _read(base / "cgroup.controllers").split():
                break
        else:
            raise CpuShareError(f"no cgroup cpu controller under {root} (v1 {root}/cpu, or v2 with `cpu` in "
                                "cgroup.controllers)")
        if not os.access(base, os.W_OK):
            raise CpuShareError(f"the cgroup cpu controller at {base} is not writable: enforcing a CPU share needs "
                                "root or a delegated cgroup")
        return cls(base, version)

    def limit(self, pid: int, share: float, name: str) -> Path:
        """Moves process ``pid`` (all its threads) into group ``name`` with a quota of ``share`` CPUs; its path."""
        if not share > 0:
            raise ValueError(f"a CPU share must be > 0, got {share}")
        self._prepare_parent()
        group = self.base / name
        group.mkdir(exist_ok=True)
        quota = max(1000, round(share * PERIOD_US))  # the kernel refuses quotas under 1 ms
        if self.version == 1:
            _write(group / "cpu.cfs_period_us", str(PERIOD_US))
            _write(group / "cpu.cfs_quota_us", str(quota))
        else:
            _write(group / "cpu.max", f"{quota} {PERIOD_US}")
        _write(group / "cgroup.procs", str(pid))
        return group

    def quota_us(self, group: Path) -> int:
        """The quota of ``group`` per ``PERIOD_US`` (-1: none)."""
        if self.version == 1:
            return int(_read(group / "cpu.cfs_quota_us"))
        quota = _read(group / "cpu.max").split()[0]
        return -1 if quota == "max" else int(quota)

    def sweep(self) -> None:
        """Removes the groups no process is in any more (those of replicas that ended)."""
        if not self.base.is_dir():
            return
        for group in self.base.iterdir():
            if group.is_dir() and not _read(group / "cgroup.procs").strip():
                with contextlib.suppress(OSError):  # a process moved in meanwhile
                    group.rmdir()

    def _prepare_parent(self) -> None:
        self.base.mkdir(exist_ok=True)
        if self.version == 2:  # children of a v2 group get the cpu controller only if the group hands it down
            with contextlib.suppress(OSError):
                _write(self.base / "cgroup.subtree_control", "+cpu")


def pin_share(share: float) -> tuple[int, ...] | None:
    """From a share of 1, pins this process to ``ceil(share)`` cores, the least held (None below 1: not pinned)."""
    if share < 1:
        return None
    cores = _claim_cores(math.ceil(share), CLAIMS_DIR)
    pin_process(cores)
    return cores


def throttle(cgroups: CgroupCpu, share: float) -> Path:
    """Puts this process in its own group ``pid-<pid>`` with a quota of ``share`` CPUs; the group's path."""
    cgroups.sweep()
    return cgroups.limit(os.getpid(), share, f"pid-{os.getpid()}")


def _claim_cores(count: int, claims: Path) -> tuple[int, ...]:
    """``count`` of this process's allowed cores, the ones the live swiftserve processes of the node hold least;
    recorded for the next (under a lock, so two replicas starting at once do not pick the same)."""
    allowed = sorted(os.sched_getaffinity(0))
    if count > len(allowed):
        raise CpuShareError(f"a share of {count} whole cores needs {count} cores; this process may use "
                            f"{len(allowed)}")
    claims.mkdir(parents=True, exist_ok=True)
    with open(claims / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = claims / "cores"
        held = _live_claims(path)
        load = {core: sum(core in cores for cores in held.values()) for core in allowed}
        chosen = tuple(sorted(sorted(allowed, key=lambda core: (load[core], core))[:count]))
        held[os.getpid()] = chosen
        path.write_text("".join(f"{pid} {' '.join(map(str, cores))}\n" for pid, cores in held.items()))
    return chosen


def _live_claims(path: Path) -> dict[int, tuple[int, ...]]:
    claims: dict[int, tuple[int, ...]] = {}
    for line in _read(path).splitlines():
        pid, *cores = (int(field) for field in line.split())
        if Path(f"/proc/{pid}").exists() and pid != os.getpid():
            claims[pid] = tuple(cores)
    return claims


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CpuShareError(f"cannot write {value!r} to {path}: {exc}") from exc


def enforces_replica_share(init: Init) -> Init:
    """Decorates a replica's ``__init__`` (plain or async) to enforce ``SWIFTSERVE_CPU_SHARE`` (nothing when
    unset): whole cores pinned before it runs, the quota set once it returns, and logged. A node that cannot
    enforce the share logs why, and the replica runs with the share only reserved (as on a cluster whose pods' CPU
    limits enforce it)."""
    return around_init(_ReplicaShare.pinned, _throttle)(init)


def _throttle(share: _ReplicaShare | None) -> None:
    if share is not None:
        share.throttle()


@dataclass
class _ReplicaShare:
    """``SWIFTSERVE_CPU_SHARE`` on a starting replica: pinned, to be throttled once started."""

    deployment: str
    cgroups: CgroupCpu
    cores: tuple[int, ...] | None

    @classmethod
    def pinned(cls, deployment: str) -> _ReplicaShare | None:
        """Checks the node can enforce the share and pins the whole cores; None when unset or it cannot."""
        if constants.CPU_SHARE is None:
            return None
        try:
            cgroups = CgroupCpu.find()
            return cls(deployment, cgroups, pin_share(constants.CPU_SHARE))
        except CpuShareError as error:
            _not_enforced(deployment, error)
            return None

    def throttle(self) -> None:
        """Sets the quota and logs it (or why the node refused it)."""
        try:
            group = throttle(self.cgroups, constants.CPU_SHARE)
        except CpuShareError as error:
            _not_enforced(self.deployment, error)
            return
        logger.info("%s replica: %s", self.deployment,
                    EnforcedShare(group, self.cgroups.quota_us(group), self.cores).describe())


def _not_enforced(deployment: str, error: CpuShareError) -> None:
    logger.warning("%s replica: SWIFTSERVE_CPU_SHARE=%g not enforced: %s", deployment, constants.CPU_SHARE, error)
