"""Shared plumbing of the benchmark scripts: timing, machine description, result files."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, object]:
    """Where the numbers were measured."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": device,
        "cuda": torch.cuda.is_available(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def timed(run: Callable[[], object], repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``run``."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def summary(seconds: list[float]) -> dict[str, float]:
    return {"mean_s": statistics.fmean(seconds), "median_s": statistics.median(seconds),
            "min_s": min(seconds), "max_s": max(seconds), "runs": len(seconds)}


def write_results(name: str, payload: dict, table: str) -> None:
    """``results/<name>.json`` (everything) and ``results/<name>.md`` (the table people read)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table + "\n")
