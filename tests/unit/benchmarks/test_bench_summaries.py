"""The summaries bench_lora, bench_overload and bench_autoconfig write beside their tables."""

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


def test_bench_autoconfig_states_the_gain_and_minutes_per_family_only_from_what_entries_recorded():
    import numpy as np

    from autoconfig.bank import StartingPoint
    from autoconfig.space import SearchSpace
    from benchmarks.bench_autoconfig import tuning_gains
    from tests.helpers.surfaces import grid_entry

    dlrm = SearchSpace.parse({"knobs": {"max_batch_size": {"values": [1, 2]}, "device_share": {"values": [1.0]},
                                        "num_replicas": {"values": [1]}}})
    diffusion = SearchSpace.parse({"knobs": {**dlrm.to_dict()["knobs"], "torch_threads": {"values": [1]}}})
    shipped = StartingPoint(status="ok", rps=1.0, objective=1.0)
    entries = [grid_entry("a", [2.0, 4.0], dlrm).model_copy(update={"starting": shipped}),
               grid_entry("b", [3.0, 1.0], dlrm).model_copy(update={"starting": shipped}),
               grid_entry("c", [1.0, 2.0], dlrm),
               grid_entry("d", [5.0, 1.0], diffusion)]
    minutes = {"a": np.array([2.0, 4.0]), "b": np.array([np.nan, np.nan]), "c": np.array([1.0, 1.0])}  # d: not replayed
    gains = tuning_gains(entries, minutes)
    assert gains["median_gain_over_shipped"] == 3.5 and gains["models_with_shipped"] == 2  # of 4.0 and 3.0
    assert gains["median_minutes_to_within_5pct"] == 1.5 and gains["models_with_durations"] == 2  # of 2, 4, 1, 1
    assert gains["families"]["diffusion"] == {"median_gain_over_shipped": None, "models_with_shipped": 0,
                                              "median_minutes_to_within_5pct": None, "models_with_durations": 0}
    assert gains["families"]["dlrm"]["median_gain_over_shipped"] == 3.5
