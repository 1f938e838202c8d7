"""``bench_dlrm`` rerun for some sections only: the others are carried over from the committed results and reported
at the batch sizes and replica counts they were measured at."""

import json

from benchmarks import bench_dlrm

GiB = 2**30


def _row(rate: float) -> dict:
    return {"p50_ms": [10.0, 11.0], "p99_ms": [20.0], "rows_per_s": [rate, rate], "bytes_per_request": None,
            "cpu_us_per_row": [{"MonolithicDLRM": 50.0}], "errors": [{}]}


def _scaled(gib: float, rate: float) -> dict:
    return {"memory": {"rss": gib * GiB, "uss": gib * GiB, "pss": gib * GiB}, "rows_per_s": [rate], "errors": [0],
            "threads": 1}


def test_sections_carried_over_are_reported_at_the_sizes_they_measured(tmp_path, monkeypatch):
    committed = {"commit": "abc1234", "rows": {
        "same_cores": {"monolithic": {32: _row(1000.0)}, "disagg_fp32": {32: _row(800.0)}},
        "scale_out": {name: {1: _scaled(1.0, 100.0), 2: _scaled(gib, 180.0)}
                      for name, gib in (("monolithic", 2.0), ("disaggregated", 1.0), ("disaggregated_int8", 0.5))},
    }}
    (tmp_path / "bench_dlrm.json").write_text(json.dumps(committed))  # JSON makes the sizes strings
    monkeypatch.setattr(bench_dlrm, "RESULTS", tmp_path)
    results: dict = {}
    assert bench_dlrm.carry_over(results) == {"same_cores": "abc1234", "scale_out": "abc1234"}
    assert list(results["scale_out"]["monolithic"]) == [1, 2]
    # This run's arguments name other sizes than the carried sections measured.
    table, summary = bench_dlrm.report(bench_dlrm.arguments().parse_args(["--batches", "256", "--replicas", "4"]),
                                       results)
    assert "| 32 | disagg_fp32 | 10.5 [10.0, 11.0] | 20.0 [20.0, 20.0] | 800 [800, 800] | 0.80x |" in table
    assert "| 2 | disaggregated_int8 | 0.50 | 0.50 | 0.50 | 180 [180, 180] | 360 |" in table
    assert summary["throughput_ratio_same_cores"] == 0.8
    assert summary["memory_ratio_n2"] == 0.5
