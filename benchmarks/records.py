"""Where benchmark numbers come from and where they go: the machine, the commit and command, timing summaries,
and the result files (``<name>.json`` + ``<name>.md``). Imports torch and the standard library only (through
``autoconfig.provenance`` too), so it runs on a bare GPU machine."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from autoconfig.provenance import cpu_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


def machine() -> dict[str, object]:
    """Where the numbers were measured."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": device,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def provenance(repo: Path = REPO) -> dict[str, str]:
    """``commit`` (``-dirty`` when the tree has changes other than results: a run after another in the same tree
    measures the same code), ``date`` (UTC) and the ``command`` that ran."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", ".", f":(exclude){RESULTS.relative_to(REPO)}"):
        commit += "-dirty"
    script = Path(sys.argv[0]).resolve()
    module = ".".join(script.relative_to(REPO).with_suffix("").parts) if script.is_relative_to(REPO) else str(script)
    return {"commit": commit, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", module, *sys.argv[1:]])}


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


def write_results(name: str, payload: dict, table: str, directory: Path = RESULTS) -> None:
    """``<directory>/<name>.json`` (everything; paths, such as a script's arguments, as strings) and ``<name>.md``
    (the table people read); ``results/`` by default."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(payload, indent=2, default=_path_as_text) + "\n")
    (directory / f"{name}.md").write_text(table + "\n")


def _path_as_text(value: object) -> str:
    """JSON for a ``Path``; any other type JSON does not know stays an error."""
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
