"""Smoke run of bench_diffusion on the tiny preset: every case of both systems, and the cold-LoRA rows' distance
from the exact image."""

import json
import subprocess
import sys

from benchmarks.records import REPO


def test_the_tiny_run_times_every_case_and_measures_how_far_a_cold_lora_image_is_from_the_exact_one(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_diffusion", "--preset", "tiny", "--size", "64",
                           "--steps", "4", "--rank", "4", "--repeats", "1", "--out", str(tmp_path),
                           "--lora-store-mb-per-s", "0.01"],  # a remote fetch of seconds: the LoRA comes late
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "bench_diffusion.json").read_text())
    assert payload["errors"] == 0
    diffs = payload["cold_lora_mean_abs_pixel_diff"]
    assert set(diffs) == {"0c-1l cold", "0c-1l cold remote"}
    assert all(len(runs) == 1 for runs in diffs.values())
    assert 0 < diffs["0c-1l cold remote"][0] < 255  # its first steps ran without the LoRA
    assert 0 <= diffs["0c-1l cold"][0] < 255  # from the local disk it may be ready before the first step
    assert {"ratio_1c1l_to_0c0l", "ratio_cold_lora_to_0c0l", "ratio_cfg_parallel"} <= set(payload["summary"])
    assert "differs from the exact one" in (tmp_path / "bench_diffusion.md").read_text()
