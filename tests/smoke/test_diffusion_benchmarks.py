"""Smoke runs of the diffusion benchmark scripts (tiny presets, a request or a few per case)."""

import subprocess
import sys

import pytest

from benchmarks.records import REPO
from serving.common.allocator import TUNED_MALLOC_ENV


def test_bench_diffusion_times_every_katz_row_and_measures_how_far_a_cold_lora_image_is_from_the_exact_one(
        run_benchmark, tmp_path):
    payload = run_benchmark("bench_diffusion", "--preset", "tiny", "--size", "64", "--steps", "4", "--rank", "4",
                            "--repeats", "1",
                            "--lora-store-mb-per-s", "0.01",  # a remote fetch of seconds: the LoRA comes late
                            "--merged-cache-mib", "1", "--lora-cache-mib", "64",
                            result="bench_diffusion_tiny")
    assert payload["errors"] == 0
    assert {row["row"] for row in payload["comparisons"]} >= {"0c-0l", "1c-1l", "3c-2l", "0c-0l parallel CFG"}
    assert all(row["runs"] == 1 for row in payload["rows"])
    diffs = payload["cold_lora_mean_abs_pixel_diff"]
    assert set(diffs) == {"0c-1l cold", "0c-1l cold remote"}
    assert all(len(runs) == 1 for runs in diffs.values())
    assert 0 < diffs["0c-1l cold remote"][0] < 255  # its first steps ran without the LoRA
    assert 0 <= diffs["0c-1l cold"][0] < 255  # from the local disk it may be ready before the first step
    assert {"tiny_ratio_1c1l_to_0c0l", "tiny_ratio_3c2l_to_0c0l", "tiny_ratio_0c0l", "tiny_ratio_warm_lora"} <= set(
        payload["summary"])
    assert payload["goals"]["tiny_ratio_0c0l"] == "<= 1.05"
    # one round: each round's paired ratio is the ratio of the two rows' single runs
    assert set(payload["summary_paired"]) == set(payload["summary"])
    for key, value in payload["summary"].items():
        assert payload["summary_paired"][key]["repeats"] == [pytest.approx(value)]
    table = (tmp_path / "bench_diffusion_tiny.md").read_text()
    assert "differs from the exact one" in table
    assert "LoRA memory set by the command (merged copies: 1 MiB, LoRA cache: 64 MiB)" in table
    assert (payload["args"]["merged_cache_mib"], payload["args"]["lora_cache_mib"]) == (1, 64)


def test_bench_diffusion_runs_the_katz_rows_on_flux_with_true_cfg(run_benchmark):
    payload = run_benchmark("bench_diffusion", "--preset", "flux-tiny", "--size", "64", "--steps", "2", "--rank", "4",
                            "--repeats", "1", result="bench_diffusion_flux_tiny")
    assert payload["errors"] == 0
    assert (payload["request"]["guidance_scale"], payload["request"]["cfg_scale"]) == (3.5, 4.0)
    assert {"flux_tiny_ratio_cfg_parallel", "flux_tiny_ratio_3c2l_to_0c0l"} <= set(payload["summary"])


def test_profile_diffusion_profiles_every_thread_of_both_systems_and_the_denoisers_scaling(run_benchmark):
    payload = run_benchmark("profile_diffusion", "--preset", "tiny", "--size", "64", "--steps", "2", "--rank", "4",
                            "--top", "5", result="profiles/diffusion_tiny")
    cases = payload["cases"]
    assert set(cases) == {"swiftserve 0c-0l", "diffusers 0c-0l", "swiftserve 0c-0l parallel CFG"}
    assert all(len(case["top_frames"]) == 5 and case["samples"] > 0 for case in cases.values())
    assert set(cases["swiftserve 0c-0l"]["timings"]) >= {"denoise_s", "decode_s"}
    # a tiny request is far shorter than the default 2 s of sampling, so each case ran again and again under py-spy
    assert all(case["runs_sampled"] > 1 for case in cases.values())
    # the engine loop and the CFG worker each ran on a thread of their own, and py-spy sampled both
    assert len(cases["swiftserve 0c-0l parallel CFG"]["samples_per_thread"]) >= 2
    scaling = payload["denoiser_scaling"]
    assert scaling["best_parallel_cfg_denoise_ratio"] == pytest.approx(
        scaling["one_branch_each_core_at_once_s"] / scaling["cfg_batch_one_core_s"])
    blocks = scaling["blocks_s"]["one_branch_one_core"]
    assert {"conv_in", "down_blocks.0", "mid_block", "up_blocks.0", "conv_out"} <= set(blocks)
    assert all(seconds > 0 for seconds in blocks.values())
    assert set(payload["core_scaling"]) == {"compute_at_once_over_alone", "memory_at_once_over_alone"}


def test_bench_lora_records_each_lora_cases_cost_over_its_systems_no_lora_run(run_benchmark):
    payload = run_benchmark("bench_lora", "--preset", "tiny", "--size", "64", "--steps", "2", "--rank", "4",
                            "--repeats", "1")
    assert payload["commit"] and payload["command"].startswith("python -m benchmarks.bench_lora")
    assert {(case["system"], case["case"]) for case in payload["cases"]} == {
        ("diffusers", "no LoRA"), ("diffusers", "LoRA load+fuse per request"), ("swiftserve", "no LoRA"),
        ("swiftserve", "cold LoRA (background load)"), ("swiftserve", "warm LoRA (cached)")}
    assert set(payload["summary"]) == {"added_diffusers_lora_load_fuse_per_request",
                                       "added_swiftserve_cold_lora_background_load",
                                       "added_swiftserve_warm_lora_cached"}
    assert [len(reports) for reports in payload["swiftserve_lora_reports"].values()] == [1, 1]  # cold, warm


def test_bench_lora_batch_times_first_and_steady_steps_of_every_rank_against_an_engine_without_hooks(run_benchmark):
    """Two ranks: each merged case's copy must be held whole beside the other's."""
    payload = run_benchmark("bench_lora_batch", "--preset", "tiny", "--size", "64", "--rows", "2", "--ranks", "4", "8",
                            "--repeats", "1")
    rows = {(row["case"], row["rank"]): row for row in payload["rows"]}
    assert set(rows) == {("none", None), ("none_hooked", None),
                         *((kind, rank) for kind in ("mixed", "merged", "same_unmerged") for rank in (4, 8))}
    assert all(len(row["seconds"]) == 1 and len(row["first_step_seconds"]) == 1 for row in rows.values())
    assert rows[("none", None)]["ratio_to_none"]["median"] == 1.0
    assert set(payload["summary"]) == {"ratio_mixed_to_none_rank8"}


def test_bench_streaming_runs_every_arm_and_counts_each_preview(run_benchmark):
    payload = run_benchmark("bench_streaming", "--steps", "2", "--requests", "4", "--clients", "2", "--repeats", "1",
                            "--partial-images", "1")
    assert [row["arm"] for row in payload["rows"]] == ["baseline", "approx", "vae"]
    for row in payload["rows"]:
        assert row["ok"] == 4 and row["errors"] == row["timed_out"] == row["short_previews"] == 0
    assert payload["rows"][1]["previews_received"] == payload["rows"][1]["previews_expected"] > 0
    assert {"throughput_ratio_approx_paired_median", "throughput_ratio_vae_paired_median"} <= set(payload["summary"])


def test_bench_diffusion_throughput_serves_every_system_through_ray_serve(run_benchmark):
    payload = run_benchmark("bench_diffusion_throughput", "--preset", "tiny", "--size", "64", "--steps", "2",
                            "--requests", "4", "--repeats", "1", "--controlnets", "1", "--loras", "2", "--rank", "4")
    assert [row["system"] for row in payload["rows"]] == ["vanilla", "strongest_vanilla", "ours", "ours_cb_off"]
    for row in payload["rows"]:
        assert row["ok"] + row["refused"] == 4 and row["errors"] == row["timed_out"] == 0
    assert 0 < payload["summary"]["engine_busy_fraction"] <= 1
    assert {"ratio_vs_vanilla", "ratio_vs_strongest_vanilla", "ratio_cb_on_vs_off"} <= set(payload["summary"])


def test_bench_overload_measures_capacity_then_soaks_past_it_and_samples_every_serve_process(run_benchmark,
                                                                                             tmp_path):
    payload = run_benchmark("bench_overload", "--apps", "diffusion", "--minutes", "0.1", "--capacity-s", "3",
                            "--sample-s", "1", "--steps", "2", result="bench_overload_diffusion")
    diffusion = payload["apps"]["diffusion"]
    assert diffusion["capacity"]["ok"] > 0 and diffusion["capacity"]["other"] == 0
    assert diffusion["overload"]["sent"] > diffusion["overload"]["ok"] > 0  # 3x capacity: some are refused
    assert diffusion["overload"]["refused_503"] == diffusion["overload"]["refused_with_retry_after"]
    assert any(name.startswith("ServeReplica:diffusion:DiffusionModel") for name in payload["rss"])
    assert {"diffusion_ok_over_capacity", "diffusion_refused_share", "max_rss_slope_mib_per_min"} <= set(
        payload["summary"])
    assert (tmp_path / "bench_overload_diffusion.png").stat().st_size > 0


def test_bench_gpu_share_refuses_a_machine_without_cuda_saying_so():
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu_share"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "no CUDA device here" in done.stderr


def test_bench_trace_replays_a_short_trace_through_every_system_in_process(run_benchmark, tmp_path):
    """Three traced requests (text-to-image with a LoRA, image-to-image, inpainting) through production, strongest
    and ours (no Ray), each answered, judged and summarised."""
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "gmt_create,predict_type,predict_status,exec_time_seconds,groupId,prompt_length,negative_prompt_length,"
        "num_images_per_prompt,num_inference_steps,checkpoint_model_version_id,num_lora\n"
        "2024-12-05 23:42:41,TXT_2_IMG,SUCCEED,32.0,G0,20.0,10.0,2.0,30.0,M1,1\n"
        "2024-12-05 23:42:43,IMG_2_IMG,SUCCEED,32.0,G0,20.0,,1.0,30.0,M2,0\n"
        "2024-12-05 23:42:45,INPAINTING,FAILED,32.0,G1,20.0,,1.0,30.0,M1,0\n")
    latencies = tmp_path / "latency.csv"
    latencies.write_text("timestamp_anon,value,container_ip\n1.0,400.0,a\n2.0,600.0,b\n")
    payload = run_benchmark(
        "bench_trace", "--trace", str(trace), "--load-latencies", str(latencies), "--in-process", "--hours", "0.01",
        "--compression", "2", "--models", "2", "--loras-per-model", "2", "--rank", "2", "--repeats", "1",
        "--calibration-sends", "1")
    assert [row["system"] for row in payload["rows"]] == ["production", "strongest", "ours"]
    for row in payload["rows"]:
        assert row["sent"] == 3 and row["ok"] + row["refused"] + row["errors"] + row["timed_out"] == 3
        assert row["errors"] == 0 and row["timed_out"] == 0
    assert payload["workload"]["kinds"] == {"generate": 1, "img2img": 1, "inpaint": 1}
    assert payload["workload"]["model_map"] == {"M1": "m0", "M2": "m1"}
    assert {"goodput_ratio_vs_production", "goodput_ratio_vs_strongest", "slo_attainment", "p50_s_ours",
            "p99_s_production"} <= set(payload["summary"])
    assert payload["commit"] and "in one process" in (tmp_path / "bench_trace.md").read_text()


def test_bench_allocator_measures_the_band_decode_and_freed_memory_under_each_malloc_setting(run_benchmark):
    payload = run_benchmark("bench_allocator", "--preset", "tiny", "--size", "64", "--repeats", "1",
                            "--probe-mib", "64", "--rounds", "2")
    settings = payload["settings"]
    assert set(settings) == {"default", "one_arena", "mmap_4mib", "tuned"}
    assert settings["one_arena"]["env"] == {"MALLOC_ARENA_MAX": "1"}
    assert settings["tuned"]["env"] == TUNED_MALLOC_ENV
    for result in settings.values():
        decode = result["band_decode"]
        assert decode["banded_over_whole"] == pytest.approx(decode["banded_s"] / decode["whole_s"])
        assert decode["whole_faults"] >= 0 and decode["banded_faults"] >= 0
        assert len(result["resident_gib"]["after_rounds"]) == 2
    # 6.5 MB blocks over a fixed 4 MiB threshold are unmapped when freed; glibc's default keeps the second round's
    probe_gib = 64 / 1024
    assert settings["default"]["resident_gib"]["growth"] > probe_gib / 2
    assert settings["mmap_4mib"]["resident_gib"]["growth"] < probe_gib / 4
    assert {"band_over_whole_one_arena", "resident_growth_gib_default"} <= set(payload["summary"])
