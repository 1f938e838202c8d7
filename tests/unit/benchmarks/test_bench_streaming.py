"""bench_streaming's summary: paired per-round ratios, and when a difference is a tie."""

import pytest

from benchmarks.bench_streaming import BASELINE, arms, summarize

ARMS = arms(3)


def _figures(rates: dict[str, list[float]]) -> dict:
    return {name: {"images_per_s": {"median": sorted(values)[len(values) // 2], "repeats": values},
                   "tail": "p99", "tail_s_median": 1.0, "ok": len(values), "refused": 0, "errors": 0,
                   "timed_out": 0, "short_previews": 0} for name, values in rates.items()}


def _rows(rates: dict[str, list[float]]) -> list[dict]:
    return [{"arm": name, "repeat": i, "images_per_s": value} for name, values in rates.items()
            for i, value in enumerate(values)]


def test_a_loss_every_paired_round_shows_is_not_a_tie_though_the_ranges_of_the_repeats_overlap():
    streamed = next(arm for arm in ARMS if arm.streamed)
    rates = {BASELINE: [10.0, 12.0, 14.0], streamed.name: [9.6, 11.5, 13.4]}  # 0.96x each round, ranges overlap
    summary = summarize(_rows(rates), _figures(rates), [arm for arm in ARMS if arm.name in rates], fit_s=0.1)
    assert summary[f"throughput_ratio_{streamed.name}_paired_median"] == pytest.approx(11.5 / 12.0)
    assert summary[f"throughput_ratio_{streamed.name}_max"] < 1.0
    assert summary[f"throughput_tie_{streamed.name}"] == 0.0 and "a cost" in summary["verdict"]
    rates = {BASELINE: [10.0, 12.0, 14.0], streamed.name: [10.5, 11.0, 14.5]}  # rounds on both sides of 1
    summary = summarize(_rows(rates), _figures(rates), [arm for arm in ARMS if arm.name in rates], fit_s=0.1)
    assert summary[f"throughput_tie_{streamed.name}"] == 1.0 and "a tie" in summary["verdict"]
