"""Smoke runs of the benchmark scripts: each runs as its command line runs it, in a process of its own, on a tiny
preset for seconds, so that none can rot unnoticed. A script that uses Ray starts and stops its own local cluster,
as its command does; this session starts none and runs the scripts one at a time (`make test` runs it after the
integration session has stopped its cluster)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.records import REPO

#: Longest a smoke run may take (a Ray script deploys apps first).
SMOKE_TIMEOUT_S = 600


@pytest.fixture
def run_benchmark(tmp_path: Path):
    """Runs ``python -m benchmarks.<module> *args --out <tmp>``; returns its result file (``<result>.json``,
    by default ``<module>.json``) parsed, or ``None`` when ``result`` is ``""``. A run that fails shows its stderr's
    end."""

    def run(module: str, *args: str, result: str | None = None) -> dict | None:
        command = [sys.executable, "-m", f"benchmarks.{module}", *args, "--out", str(tmp_path)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((tmp_path / f"{result or module}.json").read_text()) if result != "" else None

    return run
