"""The summaries bench_lora and bench_overload write beside their tables."""

import pytest

from benchmarks.bench_lora import summary_key
from benchmarks.bench_overload import overload_summary


def test_lora_summary_keys_are_snake_case_per_system_and_case():
    assert summary_key("swiftserve", "warm LoRA (cached)") == "added_swiftserve_warm_lora_cached"
    assert summary_key("diffusers", "LoRA load+fuse per request") == "added_diffusers_lora_load_fuse_per_request"


def _outcome(sent: int, ok: int, refused: int, seconds: float, p99: float | None) -> dict:
    return {"sent": sent, "ok": ok, "refused_503": refused, "other": sent - ok - refused, "ok_per_s": ok / seconds,
            "ok_p99_ms": p99}


def test_overload_summary_relates_the_soak_to_capacity_and_takes_the_steepest_memory_slope():
    results = {"dlrm": {"capacity": _outcome(100, 100, 0, 10.0, 50.0), "overload": _outcome(300, 90, 200, 10.0, 75.0)},
               "diffusion": {"capacity": _outcome(10, 10, 0, 10.0, 900.0), "overload": _outcome(0, 0, 0, 10.0, None)}}
    memory = {"a": {"slope_mib_per_min": 0.5}, "b": {"slope_mib_per_min": 2.0}}
    summary = overload_summary(results, memory)
    assert summary["dlrm_ok_over_capacity"] == pytest.approx(0.9)
    assert summary["dlrm_refused_share"] == pytest.approx(200 / 300)
    assert summary["dlrm_admitted_p99_ratio"] == pytest.approx(1.5)
    assert summary["diffusion_ok_over_capacity"] == 0.0 and summary["diffusion_refused_share"] == 0.0
    assert "diffusion_admitted_p99_ratio" not in summary  # nothing admitted: no ratio, not a zero
    assert summary["max_rss_slope_mib_per_min"] == 2.0
