"""Load smoke gate: loadtests/locustfile.py, run by Locust in its own process against the session's applications.

A short headless run with both user kinds (ControlNet `edges` and LoRA `outlined` in the image mix) must exit 0
with requests of both kinds and no failure; a run with an impossible p95 gate must exit non-zero naming the gate.
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.waiting import wait_for
from tests.integration.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOCUSTFILE = REPO / "loadtests" / "locustfile.py"
IMAGES = "/v1/images/generations"
INFER = "/v2/models/dlrm/infer"


def _wait_until_ready(http, timeout_s: float = 120.0) -> None:
    """Earlier tests kill replicas and shards; start once both applications answer their health probes."""
    seen: list[int] = []

    def ready() -> bool:
        seen[:] = [http.get(path).status_code for path in ("/health", "/v2/health/ready")]
        return seen == [200, 200]

    wait_for(ready, lambda: f"applications not ready: /health, /v2/health/ready -> {seen}", timeout_s=timeout_s,
             period_s=1.0)


def _locust(base_url: str, csv_prefix: Path, run_time: str, *options: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", base_url,
        "--users", "2", "--spawn-rate", "2", "--run-time", run_time, "--stop-timeout", "60", "--only-summary",
        "--csv", str(csv_prefix), "--controlnets", "edges", "--loras", "outlined", "--diffusion-size", "32x32",
        "--diffusion-steps", "2", "--dlrm-rows", "8", "--min-wait", "0.05", "--max-wait", "0.2", *options,
    ]  # fmt: skip
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def test_locustfile_smoke_run_passes_with_both_users_and_no_failures(base_url, http, tmp_path):
    _wait_until_ready(http)
    run = _locust(base_url, tmp_path / "smoke", "15s", "--max-failure-ratio", "0", "--max-p95-ms", "60000")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "gate max-failure-ratio passed" in output and "gate max-p95-ms passed" in output, output[-4000:]

    stats = {row["Name"]: row for row in _rows(tmp_path / "smoke_stats.csv")}
    for name in (IMAGES, INFER):
        assert name in stats, f"no {name} requests in the stats: {sorted(stats)}"
        assert int(stats[name]["Request Count"]) > 0, stats[name]
        assert int(stats[name]["Failure Count"]) == 0, stats[name]
    assert _rows(tmp_path / "smoke_failures.csv") == []
    assert _rows(tmp_path / "smoke_exceptions.csv") == []


def test_locustfile_gate_fails_the_run_and_names_itself(base_url, http, tmp_path):
    _wait_until_ready(http)
    run = _locust(base_url, tmp_path / "gated", "6s", "--max-p95-ms", "0.001")
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-4000:]
    assert "gate max-p95-ms FAILED" in output, output[-4000:]
    assert "load test FAILED its gates: max-p95-ms" in output, output[-4000:]
