"""Smoke runs of the DLRM and autoconfig benchmark scripts (the tiny DLRM preset, a second or two per point; three
models of the committed profile bank replayed with one seed)."""

import json
import os
import shutil
import subprocess
import sys

from benchmarks.records import REPO, RESULTS


def test_bench_dlrm_measures_the_same_cores_section_for_both_layouts_through_ray_serve(run_benchmark):
    payload = run_benchmark("bench_dlrm", "--preset", "tiny", "--sections", "same_cores", "--batches", "32",
                            "--systems", "monolithic", "disagg_fp32", "--seconds", "1", "--latency-seconds", "1",
                            "--repeats", "1", "--latency-repeats", "1", "--clients", "2", "--max-clients", "2",
                            "--requests", "4")
    rows = payload["rows"]["same_cores"]
    assert set(rows) == {"monolithic", "disagg_fp32"}
    for system in rows.values():
        point = system["32"]
        assert point["rows_per_s"][0] > 0 and not any(point["errors"])  # errors by kind, per run
    assert payload["carried_over"] == {}  # a fresh results directory: nothing to carry over
    assert {"throughput_ratio_same_cores", "p50_ratio_same_cores"} <= set(payload["summary"])


def test_bench_shard_server_serves_one_shard_by_each_flavour(run_benchmark):
    payload = run_benchmark("bench_shard_server", "--preset", "tiny", "--batches", "32", "--seconds", "0.5",
                            "--repeats", "1", "--requests", "4", "--work-calls", "10")
    flavours = payload["rows"]["32"]["flavours"]
    assert set(flavours) == {"aio-pool-protobuf", "aio-pool", "aio-inline", "aio-inline-uvloop", "sync-pool",
                             "aio-null", "aio-stream"}
    for runs in flavours.values():
        assert runs[0]["calls_per_s"] > 0 and runs[0]["errors"] == 0
    assert {"machinery_over_tensor_work_b32", "cpu_ratio_before_over_kept_b32",
            "grpc_floor_over_tensor_work_b32"} == set(payload["summary"])


def test_bench_autoconfig_replays_every_searcher_leaving_each_model_of_a_bank_out(run_benchmark, tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    committed = RESULTS / "autoconfig_bank_v2"
    dlrm = sorted(committed.glob("dlrm-*.json"))[:2]
    diffusion = sorted(committed.glob("diffusion-*.json"))[:1]  # alone over its knobs: nothing to learn from
    for entry in [*dlrm, *diffusion]:
        shutil.copyfile(entry, bank / entry.name)
    payload = run_benchmark("bench_autoconfig", "--seeds", "1", "--bank", str(bank),
                            "--second-bank", str(tmp_path / "none"))
    assert sorted(model["model"] for model in payload["models"]) == sorted(entry.stem for entry in [*dlrm, *diffusion])
    assert payload["not_replayed"] == [entry.stem for entry in diffusion]
    assert len(payload["per_run"]["meta"]["trials_to_within"]) == len(dlrm)
    assert set(payload["tuning_gains"]["families"]) == {"dlrm", "diffusion"}
    assert {"meta", "rgpe", "random", "tpe", "gp", "prior-only", "tpe-warm"} <= set(payload["searchers"])
    assert payload["summary"]["meta_median_trials_to_optimum"] >= 1
    assert (tmp_path / "bench_autoconfig.png").stat().st_size > 0


def test_bench_autoconfig_replays_two_families_each_against_its_own_hindsight_order(run_benchmark, tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    committed = RESULTS / "autoconfig_bank_v2"
    for entry in sorted(committed.glob("dlrm-*.json"))[:2]:
        shutil.copyfile(entry, bank / entry.name)
    diffusion = json.loads(sorted(committed.glob("diffusion-*.json"))[0].read_text())
    for suffix in ("a", "b"):  # two models over the diffusion knobs (one measured surface, two names)
        diffusion["model"]["name"] = f"diffusion-{suffix}"
        (bank / f"diffusion-{suffix}.json").write_text(json.dumps(diffusion))
    payload = run_benchmark("bench_autoconfig", "--seeds", "1", "--bank", str(bank),
                            "--second-bank", str(tmp_path / "none"))
    assert payload["not_replayed"] == []
    assert {family: figures["models"] for family, figures in payload["families"].items()} == {"dlrm": 2,
                                                                                             "diffusion": 2}
    hindsight = {row["model"]: row["hindsight_order_trials"] for row in payload["reproducibility"]["models"]}
    assert hindsight["diffusion-a"] == hindsight["diffusion-b"] == 1  # their one optimum leads their own order


def test_profile_dlrm_samples_every_replica_process_of_a_system_under_load(run_benchmark, tmp_path):
    run_benchmark("profile_dlrm", "--label", "smoke", "--preset", "tiny", "--systems", "disagg_fp32",
                  "--seconds", "2", "--rate", "50", "--requests", "4", "--clients", "2", "--max-clients", "2",
                  result="")
    summary = (tmp_path / "smoke.md").read_text()
    assert "## disagg_fp32: batch 32" in summary
    assert "samples)" in summary  # at least one process's stacks were sampled and counted
    assert list(tmp_path.glob("smoke-disagg_fp32-*.txt"))


def test_profile_bank_skips_a_model_its_bank_holds_and_refuses_one_it_does_not_know(tmp_path):
    """What the bank profiler decides before profiling (a model takes hours: ``autoconfig profile`` has tests of
    its own)."""
    held = "dlrm-tiny-rows16-slo100"
    shutil.copyfile(RESULTS / "autoconfig_bank_v2" / f"{held}.json", tmp_path / f"{held}.json")
    storage = f"sqlite:///{tmp_path / 'studies.db'}"

    def profile_bank(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "benchmarks.profile_bank", "--bank", str(tmp_path),
                               "--storage", storage, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # out/ in tmp_path

    skipped = profile_bank("--only", held)
    assert skipped.returncode == 0 and f"{held}: already in {tmp_path}, skipped" in skipped.stdout
    unknown = profile_bank("--only", "no-such-model")
    assert unknown.returncode == 2 and "unknown model(s) ['no-such-model']" in unknown.stderr
    alone = profile_bank("--only", held, "--remeasure-starting")
    assert alone.returncode == 2 and "--remeasure-starting needs --top-up DIR" in alone.stderr
