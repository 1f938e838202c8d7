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


def test_sections_carried_over_are_reported_at_the_sizes_they_measured(tmp_path):
    committed = {"commit": "abc1234", "rows": {
        "same_cores": {"monolithic": {32: _row(1000.0)}, "disagg_fp32": {32: _row(800.0)}},
        "scale_out": {name: {1: _scaled(1.0, 100.0), 2: _scaled(gib, 180.0)}
                      for name, gib in (("monolithic", 2.0), ("disaggregated", 1.0), ("disaggregated_int8", 0.5))},
    }}
    (tmp_path / "bench_dlrm.json").write_text(json.dumps(committed))  # JSON makes the sizes strings
    results: dict = {}
    assert bench_dlrm.carry_over(results, tmp_path / "bench_dlrm.json") == {"same_cores": "abc1234",
                                                                            "scale_out": "abc1234"}
    assert list(results["scale_out"]["monolithic"]) == [1, 2]
    # This run's arguments name other sizes than the carried sections measured.
    table, summary = bench_dlrm.report(bench_dlrm.arguments().parse_args(["--batches", "256", "--replicas", "4"]),
                                       results)
    assert "| 32 | disagg_fp32 | 8 | 10.5 [10.0, 11.0] | 20.0 [20.0, 20.0] | 800 [800, 800] | 0.80x |" in table
    assert "| 2 | disaggregated_int8 | 0.50 | 0.50 | 0.50 | 180 [180, 180] | 360 |" in table
    assert summary["throughput_ratio_same_cores"] == 0.8
    assert summary["memory_ratio_n2"] == 0.5


def test_each_ratio_is_against_the_best_monolithic_system_on_that_measure_and_short_runs_report_their_max():
    def row(rate: float, p50: float, cpu: dict, samples: int) -> dict:
        return {"p50_ms": [p50], "p99_ms": [2 * p50], "latency_samples": [samples], "rows_per_s": [rate],
                "bytes_per_request": [], "cpu_us_per_row": [cpu], "machine": [{"idle": 0.1, "steal": 0.0}],
                "errors": [{}], "callers": 32}

    same = {  # the fastest monolithic system is not the cheapest, nor the quickest
        "monolithic": {32: row(1000.0, 12.0, {"MonolithicDLRM": 120.0}, 500)},
        "monolithic_2x1": {32: row(900.0, 10.0, {"MonolithicDLRM": 100.0}, 500)},
        "disagg_fp32": {32: row(950.0, 11.0, {"DisaggregatedDLRM": 90.0, "ShardDirectory": 5.0, "shards": 25.0},
                                80)},
    }
    table, summary = bench_dlrm.report(bench_dlrm.arguments().parse_args([]), {"same_cores": same})
    assert summary["throughput_ratio_same_cores"] == 0.95
    assert summary["p50_ratio_same_cores"] == 1.1
    assert summary["cpu_per_row_ratio_b32"] == 1.2
    # The disaggregated layout's other shape is faster but dearer: each summary ratio takes its best on that measure.
    same["disagg_fp32_2x1"] = {32: row(990.0, 13.0, {"DisaggregatedDLRM": 110.0, "shards": 25.0}, 500)}
    _, summary = bench_dlrm.report(bench_dlrm.arguments().parse_args([]), {"same_cores": same})
    assert (summary["throughput_ratio_same_cores"], summary["p50_ratio_same_cores"],
            summary["cpu_per_row_ratio_b32"]) == (0.99, 1.1, 1.2)
    assert "| 32 | disagg_fp32 | 32 | 11.0 [11.0, 11.0] | 22.0 [22.0, 22.0] max |" in table
    assert "| 32 | monolithic | 32 | 12.0 [12.0, 12.0] | 24.0 [24.0, 24.0] | 1000" in table


def test_callers_keep_the_rows_in_flight_within_their_bounds():
    args = bench_dlrm.arguments().parse_args([])
    assert [bench_dlrm.callers(args, batch) for batch in (32, 256, 2048, 8192)] == [32, 32, 8, 8]
