"""Torch device and thread selection for model replicas."""

from __future__ import annotations

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
        torch.cuda.set_per_process_memory_fraction(constants.CUDA_MEMORY_FRACTION, device)
    return device


def set_torch_threads(threads: int | None) -> None:
    """Pin this process's torch intra-op thread count (``None`` leaves torch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)


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
