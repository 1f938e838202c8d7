"""Torch device and thread selection for model replicas, and CPU core pinning (one core = one device)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import psutil
import torch

from serving.common import constants

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(requested: str = "auto") -> torch.device:
    """``auto`` picks ``SWIFTSERVE_DEVICE`` if set, else CUDA when present, else CPU. On CUDA, applies the
    ``SWIFTSERVE_CUDA_MEMORY_FRACTION`` cap to this process's allocator when set."""
    if requested == "auto":
        requested = constants.DEVICE_OVERRIDE or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but CUDA is not available")
    if device.type == "cuda" and constants.CUDA_MEMORY_FRACTION is not None:
        index = torch.cuda.current_device() if device.index is None else device.index  # torch refuses a bare "cuda"
        torch.cuda.set_per_process_memory_fraction(constants.CUDA_MEMORY_FRACTION, index)
    return device


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now: the CUDA device's free bytes (within this process's
    ``SWIFTSERVE_CUDA_MEMORY_FRACTION`` cap, when set), else the host's available memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if constants.CUDA_MEMORY_FRACTION is not None:
            free = min(free, int(constants.CUDA_MEMORY_FRACTION * total) - torch.cuda.memory_reserved(device))
        return max(0, free)
    return psutil.virtual_memory().available


def set_torch_threads(threads: int | None) -> None:
    """Pin this process's torch intra-op thread count (``None`` leaves torch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)


def pin_thread(cores: Sequence[int]) -> None:
    """Restrict the calling thread (and the threads it starts from now on) to ``cores``."""
    _set_affinity(0, _checked(cores))


def pin_process(cores: Sequence[int]) -> None:
    """Restrict every thread of this process (and those it starts later) to ``cores``, with one torch intra-op
    thread per core: the CPU stand-in for giving the process its own device."""
    allowed = _checked(cores)
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            _set_affinity(int(task), allowed)
    torch.set_num_threads(len(allowed))


def cores_for(entries: Sequence[Sequence[int]], rank: int) -> list[int] | None:
    """The cores of replica ``rank`` in a device map's entries (entry ``rank % len(entries)``); None without
    entries (the replica is not pinned)."""
    return list(entries[rank % len(entries)]) if entries else None


def _checked(cores: Sequence[int]) -> set[int]:
    allowed = set(cores)
    if not allowed:
        raise ValueError("pinning needs at least one core")
    count = os.cpu_count() or 1
    if not all(0 <= core < count for core in allowed):
        raise ValueError(f"cores {sorted(allowed)} do not exist: this machine has cores 0-{count - 1}")
    return allowed


def _set_affinity(task: int, cores: set[int]) -> None:
    try:
        os.sched_setaffinity(task, cores)
    except OSError as exc:
        if isinstance(exc, ProcessLookupError):
            raise
        raise ValueError(f"cannot pin to cores {sorted(cores)}: {exc}") from exc


def placement() -> str:
    """Where this process runs, for start-up log lines: Ray node and PID when inside Ray."""
    import os

    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return f"node={ctx.get_node_id()[:8]} pid={os.getpid()}"
    except Exception:  # pragma: no cover - Ray absent or not in a worker
        pass
    return f"pid={os.getpid()}"
