"""Smoke runs of the benchmark scripts, each in a process of its own (seconds to a minute each, tiny presets, no
Ray): they run here, one at a time, rather than beside the parallel unit tests, whose timings they would disturb."""

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
    payload = json.loads((tmp_path / "bench_diffusion_tiny.json").read_text())
    assert payload["errors"] == 0
    diffs = payload["cold_lora_mean_abs_pixel_diff"]
    assert set(diffs) == {"0c-1l cold", "0c-1l cold remote"}
    assert all(len(runs) == 1 for runs in diffs.values())
    assert 0 < diffs["0c-1l cold remote"][0] < 255  # its first steps ran without the LoRA
    assert 0 <= diffs["0c-1l cold"][0] < 255  # from the local disk it may be ready before the first step
    assert {"tiny_ratio_1c1l_to_0c0l", "tiny_ratio_3c2l_to_0c0l", "tiny_ratio_0c0l", "tiny_ratio_warm_lora"} <= set(
        payload["summary"])
    assert "differs from the exact one" in (tmp_path / "bench_diffusion_tiny.md").read_text()


def test_a_short_trace_replays_through_every_system_in_process_and_writes_its_summary(tmp_path):
    """The smoke run of the script (no Ray): three traced requests (text-to-image with a LoRA, image-to-image,
    inpainting) through production, strongest and ours, each answered, judged and summarised."""
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "gmt_create,predict_type,predict_status,exec_time_seconds,groupId,prompt_length,negative_prompt_length,"
        "num_images_per_prompt,num_inference_steps,checkpoint_model_version_id,num_lora\n"
        "2024-12-05 23:42:41,TXT_2_IMG,SUCCEED,32.0,G0,20.0,10.0,2.0,30.0,M1,1\n"
        "2024-12-05 23:42:43,IMG_2_IMG,SUCCEED,32.0,G0,20.0,,1.0,30.0,M2,0\n"
        "2024-12-05 23:42:45,INPAINTING,FAILED,32.0,G1,20.0,,1.0,30.0,M1,0\n")
    latencies = tmp_path / "latency.csv"
    latencies.write_text("timestamp_anon,value,container_ip\n1.0,400.0,a\n2.0,600.0,b\n")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_trace", "--trace", str(trace), "--load-latencies", str(latencies),
         "--in-process", "--hours", "0.01", "--compression", "2", "--models", "2", "--loras-per-model", "2",
         "--rank", "2", "--repeats", "1", "--calibration-sends", "1", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((tmp_path / "bench_trace.json").read_text())
    assert [row["system"] for row in payload["rows"]] == ["production", "strongest", "ours"]
    for row in payload["rows"]:
        assert row["sent"] == 3 and row["ok"] + row["refused"] + row["errors"] + row["timed_out"] == 3
        assert row["errors"] == 0 and row["timed_out"] == 0
    assert payload["workload"]["kinds"] == {"generate": 1, "img2img": 1, "inpaint": 1}
    assert payload["workload"]["model_map"] == {"M1": "m0", "M2": "m1"}
    assert {"goodput_ratio_vs_production", "goodput_ratio_vs_strongest", "slo_attainment", "p50_s_ours",
            "p99_s_production"} <= set(payload["summary"])
    assert payload["commit"] and "in one process" in (tmp_path / "bench_trace.md").read_text()

