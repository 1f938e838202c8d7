"""Reading GenTD26, cutting its window and mapping it onto served models (benchmarks.gentd)."""

from pathlib import Path

import numpy as np
import pytest

from benchmarks import gentd

HEADER = ("gmt_create,predict_type,predict_status,exec_time_seconds,groupId,prompt_length,negative_prompt_length,"
          "num_images_per_prompt,num_inference_steps,checkpoint_model_version_id,num_lora")


def _line(time: str = "2024-12-05 23:42:41", kind: str = "TXT_2_IMG", n: str = "1.0", steps: str = "30.0",
          model: str = "M0001", loras: str = "0", prompt: str = "63.0", negative: str = "26.0") -> str:
    return f"{time},{kind},SUCCEED,32.0,G0000,{prompt},{negative},{n},{steps},{model},{loras}"


def _trace(tmp_path: Path, *lines: str, header: str = HEADER) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("\n".join([header, *lines]) + "\n")
    return path


def test_a_trace_is_read_in_arrival_order_with_its_fields_and_empty_values_defaulted(tmp_path):
    path = _trace(tmp_path, _line("2024-12-05 23:50:00", "IMG_2_IMG", n="", loras="2", negative=""),
                  _line("2024-12-05 23:42:41", "INPAINTING", n="8.0", steps="40.0", model="M0002"),
                  "2024-12-05 23:45:00,TXT_2_IMG,PENDING,0.0,G0325,,,,,,0")  # no parameters: not replayed
    first, second = gentd.read_requests(path)
    assert (first.line, first.predict_type, first.images, first.steps, first.model) == (3, "INPAINTING", 8, 40,
                                                                                         "M0002")
    assert (second.line, second.images, second.loras, second.negative_chars, second.prompt_chars) == (2, 1, 2, 0, 63)
    assert second.created - first.created == 7 * 60 + 19


@pytest.mark.parametrize(("line", "field", "message"), [
    (_line(kind="UPSCALE"), "predict_type", "'UPSCALE' is not one of"),
    (_line(steps="thirty"), "num_inference_steps", "'thirty' is not a number"),
    (_line(steps="0.0"), "num_inference_steps", "'0.0' is not a whole number >= 1"),
    (_line(n="2.5"), "num_images_per_prompt", "'2.5' is not a whole number"),
    (_line(loras="-1"), "num_lora", "'-1' is not a whole number >= 0"),
    (_line(steps=""), "num_inference_steps", "empty"),
    (_line(model=""), "checkpoint_model_version_id", "empty on a line with other parameters"),
    (_line(time="05/12/2024 23:42"), "gmt_create", "is not a time"),
    (_line(prompt="nan"), "prompt_length", "is not a whole number"),
])
def test_a_line_that_cannot_be_read_is_refused_naming_its_line_and_field(tmp_path, line, field, message):
    path = _trace(tmp_path, _line(), _line(), line)
    with pytest.raises(gentd.TraceError) as refused:
        gentd.read_requests(path)
    assert (refused.value.line, refused.value.field) == (4, field)
    assert str(refused.value).startswith(f"{path}:4: {field}: ") and message in str(refused.value)


def test_a_trace_missing_a_column_or_every_request_is_refused(tmp_path):
    with pytest.raises(gentd.TraceError, match="num_lora: missing column"):
        gentd.read_requests(_trace(tmp_path, _line(), header=HEADER.removesuffix(",num_lora")))
    with pytest.raises(gentd.TraceError, match="holds no request"):
        gentd.read_requests(_trace(tmp_path))


def test_load_latencies_are_read_and_a_bad_one_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "latency.csv"
    path.write_text("timestamp_anon,value,container_ip\n1.0,7109.0,a\n2.0,4018.0,b\n")
    assert gentd.read_load_latencies_ms(path).tolist() == [7109.0, 4018.0]
    path.write_text("timestamp_anon,value,container_ip\n1.0,7109.0,a\n2.0,0,b\n")
    with pytest.raises(gentd.TraceError, match=r"latency.csv:3: value: '0' is not a latency > 0"):
        gentd.read_load_latencies_ms(path)


def _requests(times: list[float], models: list[str] | None = None, loras: int = 0) -> list[gentd.TracedRequest]:
    models = models or ["M0"] * len(times)
    return [gentd.TracedRequest(i + 2, t, "TXT_2_IMG", 1, 30, m, loras, 10, 0)
            for i, (t, m) in enumerate(zip(times, models, strict=True))]


def test_the_busiest_window_is_the_one_holding_the_most_arrivals():
    times = [0.0, 100.0, 5000.0, 5100.0, 5200.0, 8000.0, 9000.0]
    start, end = gentd.busiest_window(_requests(times), hours=0.5)
    assert (start, end) == (5000.0, 6800.0)
    assert [r.created for r in gentd.in_window(_requests(times), start, end)] == [5000.0, 5100.0, 5200.0]


def test_the_top_models_get_a_served_model_each_and_the_rest_are_dealt_over_them_by_rank():
    models = ["A"] * 5 + ["B"] * 4 + ["C"] * 3 + ["D"] * 2 + ["E"]
    mapping = gentd.served_model_names(_requests([0.0] * len(models), models), count=2)
    assert mapping == {"A": "m0", "B": "m1", "C": "m0", "D": "m1", "E": "m0"}


def test_replay_compresses_arrivals_scales_steps_and_draws_distinct_loras_of_the_served_models_pool():
    traced = _requests([100.0, 150.0, 200.0], ["A", "B", "A"], loras=3)
    replayed = gentd.replay(traced, 100.0, compression=10.0, step_scale=0.1, models={"A": "m0", "B": "m1"},
                            loras_per_model=4, zipf_exponent=1.1, max_prompt_chars=2000, seed=7)
    assert [r.line for r in replayed] == [2, 3, 4]
    for request, created in zip(replayed, [100.0, 150.0, 200.0], strict=True):
        assert (created - 100.0) / 10 <= request.offset_s < (created + 1 - 100.0) / 10  # within its traced second
        assert request.steps == 3 and len(request.prompt) == 10 and request.negative_prompt is None
        assert len(set(request.loras)) == 3
        assert all(name.startswith(f"{request.model}_lora") and int(name.rsplit("lora", 1)[1]) < 4
                   for name in request.loras)
    assert [r.model for r in replayed] == ["m0", "m1", "m0"]
    assert [r.seed for r in replayed] == [7, 8, 9]
    again = gentd.replay(traced, 100.0, compression=10.0, step_scale=0.1, models={"A": "m0", "B": "m1"},
                         loras_per_model=4, zipf_exponent=1.1, max_prompt_chars=2000, seed=7)
    assert again == replayed


def test_replay_asks_for_at_most_the_whole_pool_at_least_one_step_and_prompts_within_the_limit():
    traced = [gentd.TracedRequest(2, 0.0, "INPAINTING", 8, 5, "A", 6, 3000, 40)]
    (request,) = gentd.replay(traced, 0.0, compression=1.0, step_scale=0.1, models={"A": "m0"},
                              loras_per_model=2, zipf_exponent=1.1, max_prompt_chars=100, seed=0)
    assert (request.kind, request.n, request.steps) == ("inpaint", 8, 1)
    assert sorted(request.loras) == ["m0_lora0", "m0_lora1"]
    assert len(request.prompt) == 100 and len(request.negative_prompt) == 40


def test_the_zipf_draw_favours_the_first_loras_of_a_pool():
    traced = _requests([0.0] * 2000, loras=1)
    replayed = gentd.replay(traced, 0.0, compression=1.0, step_scale=1.0, models={"M0": "m0"}, loras_per_model=8,
                            zipf_exponent=1.1, max_prompt_chars=2000, seed=0)
    counts = np.bincount([int(r.loras[0].rsplit("lora", 1)[1]) for r in replayed], minlength=8)
    weights = 1 / np.arange(1, 9) ** 1.1
    assert np.allclose(counts / 2000, weights / weights.sum(), atol=0.03)
