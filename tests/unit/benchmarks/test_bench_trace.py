"""bench_trace's requests, its judging of goodput and its summary; the open-loop client it drives them with."""

import asyncio
import email.parser
import json

import numpy as np
import pytest
from aiohttp import web

from autoconfig.workloads import HttpRequest
from benchmarks import bench_trace, gentd
from benchmarks.common import Outcomes, open_loop, server_timings
from serving.config import DiffusionAppConfig
from serving.images import decode_image_bytes, decode_mask


def _request(kind: str = "generate", n: int = 2, steps: int = 3, loras: tuple[str, ...] = ("m1_lora0",),
             negative: str | None = "blurry", seed: int = 5) -> gentd.ReplayedRequest:
    return gentd.ReplayedRequest(0.0, kind, "m1", n, steps, loras, "a red circle", negative, seed, 10)


def test_a_text_to_image_request_is_a_json_generation_naming_its_model_loras_and_sizes():
    request = bench_trace.http_request(_request(), size=64)
    assert (request.method, request.path, dict(request.headers)) == (
        "POST", "/v1/images/generations", {"content-type": "application/json"})
    body = json.loads(request.body)
    assert body == {"prompt": "a red circle", "model": "m1", "n": 2, "size": "64x64", "num_inference_steps": 3,
                    "guidance_scale": 7.5, "seed": 5, "negative_prompt": "blurry",
                    "loras": [{"name": "m1_lora0", "scale": 0.8}]}


def _form(request: HttpRequest) -> dict[str, bytes]:
    head = f"Content-Type: {request.headers['content-type']}\r\n\r\n".encode()
    message = email.parser.BytesParser().parsebytes(head + request.body)
    return {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
            for part in message.get_payload()}


@pytest.mark.parametrize("kind", ["img2img", "inpaint"])
def test_an_edit_is_a_multipart_form_with_a_seeded_image_and_a_mask_only_for_inpainting(kind):
    request = bench_trace.http_request(_request(kind, negative=None), size=64)
    assert request.path == "/v1/images/edits"
    form = _form(request)
    assert form["model"] == b"m1" and form["n"] == b"2" and form["num_inference_steps"] == b"3"
    assert json.loads(form["loras"]) == [{"name": "m1_lora0", "scale": 0.8}] and "negative_prompt" not in form
    image = decode_image_bytes(form["image"], max_bytes=2**20, max_pixels=2**20)
    assert image.shape == (64, 64, 3) and image.std() > 0
    assert _form(bench_trace.http_request(_request(kind), size=64))["image"] == form["image"]  # seeded
    assert _form(bench_trace.http_request(_request(kind, seed=6), size=64))["image"] != form["image"]
    assert ("mask" in form) == (kind == "inpaint")
    if kind == "inpaint":
        mask = decode_mask(form["mask"], max_bytes=2**20, max_pixels=2**20)
        assert mask[32, 32] == 255 and mask[0, 0] == 0 and (mask == 255).mean() == 0.25


def _outcomes(answers: list[tuple[int, int, float]]) -> Outcomes:
    out = Outcomes()
    for index, status, seconds in answers:
        out.add(index, status, seconds, None)
    return out


def test_a_request_is_good_when_answered_200_within_the_slo_of_its_own_shape():
    replayed = [_request(n=1), _request(n=8), _request(n=1), _request("img2img", n=1), _request(n=8)]
    unloaded = {("generate", 1, 3): 0.1, ("generate", 8, 3): 0.5, ("img2img", 1, 3): 0.2}
    out = _outcomes([(4, 200, 2.4), (1, 200, 2.6), (0, 200, 0.49), (2, 503, 0.01), (3, 200, 0.51)])
    assert bench_trace.judge(out, replayed, unloaded, slo_factor=5.0) == [True, False, False, True, True]


def test_a_run_counts_goodput_over_the_window_and_attainment_by_kind():
    replayed = [_request(n=1, loras=()), _request(n=1), _request("img2img", n=1), _request("img2img", n=1)]
    out = _outcomes([(0, 200, 0.1), (1, 200, 0.3), (2, 429, 0.0), (3, 200, 0.2)])
    out.first_scheduled, out.answered, out.send_lag = out.answered[0] - 1.0, out.answered, [0.0] * 4
    row = bench_trace.run_row("ours", 0, out, [True, False, False, True], replayed, window_s=30.0)
    assert (row["ok"], row["refused"], row["good"]) == (3, 1, 2)
    assert row["goodput_per_min"] == pytest.approx(4.0) and row["slo_attainment"] == 0.5
    assert row["slo_attainment_by_kind"] == {"generate": 0.5, "img2img": 0.5}
    assert row["slo_attainment_with_loras"] == pytest.approx(1 / 3)
    assert row["p50_s"] == pytest.approx(0.2)
    assert (row["tail"], row["p99_s"]) == ("max", pytest.approx(0.3))  # 3 successes: the p99 is their maximum


def _row(system: str, goodput: float, attainment: float, p50: float, p99: float) -> dict:
    return {"system": system, "goodput_per_min": goodput, "slo_attainment": attainment, "p50_s": p50, "p99_s": p99,
            "tail": "p99",
            "sent": 10, "ok": 10, "good": 5, "refused": 0, "errors": 0, "timed_out": 0}


def test_the_summary_divides_ours_median_goodput_by_each_baselines_and_flags_ties():
    rows = [_row("production", g, 0.2, 1.0, 3.0) for g in (10.0, 12.0, 11.0)] + \
           [_row("strongest", g, 0.5, 0.5, 2.0) for g in (20.0, 26.0, 30.0)] + \
           [_row("ours", g, a, 0.3, 1.0) for g, a in ((28.0, 0.9), (33.0, 0.95), (30.0, 0.92))]
    summary, ties = bench_trace.summarize(bench_trace.aggregate(rows))
    assert summary["goodput_ratio_vs_production"] == pytest.approx(30.0 / 11.0)
    assert summary["goodput_ratio_vs_strongest"] == pytest.approx(30.0 / 26.0)
    assert summary["slo_attainment"] == 0.92
    assert (summary["p50_s_production"], summary["p99_s_strongest"], summary["p99_s_ours"]) == (1.0, 2.0, 1.0)
    assert ties == {"goodput_ratio_vs_production": False, "goodput_ratio_vs_strongest": True}


def test_the_open_loop_client_sends_each_request_to_its_own_path_and_records_which_answer_is_whose():
    async def scenario() -> tuple[Outcomes, list[str]]:
        seen = []

        async def slow(request: web.Request) -> web.Response:
            seen.append(request.path)
            await asyncio.sleep(0.3)
            return web.json_response({"data": [{"b64_json": "aGk="}], "timings": {"total_s": 0.25, "queue_s": 0.1}})

        async def fast(request: web.Request) -> web.Response:
            seen.append(request.path + ":" + (await request.text()))
            return web.Response(status=503)

        app = web.Application()
        app.router.add_post("/slow", slow)
        app.router.add_post("/fast", fast)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        requests = bench_trace.Requests([HttpRequest("POST", "/slow", b"a", {}),
                                         HttpRequest("POST", "/fast", b"b", {})])
        try:
            return await open_loop(f"http://127.0.0.1:{port}", requests, [0.0, 0.05]), seen
        finally:
            await runner.cleanup()

    out, seen = asyncio.run(scenario())
    assert sorted(seen) == ["/fast:b", "/slow"]
    assert out.indices == [1, 0] and out.statuses == [503, 200]
    assert np.all(np.array(out.seconds) >= 0) and out.seconds[1] >= 0.3
    assert out.server_timings == [None, {"total_s": 0.25, "queue_s": 0.1}]


def test_server_timings_are_read_from_an_answer_without_parsing_its_images():
    body = b'{"created":1,"data":[{"b64_json":"x}y"}],"seed":3,"timings":{"queue_s":0.5,"total_s":1.0},"lora":null}'
    assert server_timings(body) == {"queue_s": 0.5, "total_s": 1.0}
    assert server_timings(b'{"error":{"message":"no"}}') is None
    assert server_timings(b'{"timings":{"total_s":') is None  # cut short


def test_the_time_split_puts_good_and_late_answers_apart_and_ignores_refusals():
    out = Outcomes()
    out.add(0, 200, 0.4, None, {"total_s": 0.3, "queue_s": 0.1})
    out.add(1, 200, 2.0, None, {"total_s": 1.5, "queue_s": 1.2})
    out.add(2, 200, 3.0, None, {"total_s": 2.0, "queue_s": 1.0})
    out.add(3, 503, 0.01, "1")
    split = bench_trace.time_split(out, [True, False, False, False])
    assert split["good"] == {"count": 1, "latency_s": 0.4, "queue_s": 0.1, "total_s": 0.3,
                             "outside_s": pytest.approx(0.1)}
    assert split["late"]["count"] == 2 and split["late"]["latency_s"] == 2.5
    assert split["late"]["queue_s"] == pytest.approx(1.1) and split["late"]["outside_s"] == pytest.approx(0.75)


def test_by_load_deals_the_busiest_models_first_onto_the_least_loaded_core():
    replayed = [gentd.ReplayedRequest(0.0, "generate", model, 1, 3, (), "p", None, i, i)
                for i, model in enumerate(["m0"] * 5 + ["m1"] * 3 + ["m2"] * 2 + ["m3"] * 2)]
    assert bench_trace.cores_by_load(replayed, 4) == [[[0]], [[1]], [[1]], [[0]]]


def test_ours_shared_is_one_group_deployment_with_a_replica_per_core_and_per_core_one_per_model():
    configs = [DiffusionAppConfig(model={"name": f"m{k}", "preset": "tiny"}, device_map={"model": [[0], [1]]})
               for k in range(3)]
    shared = bench_trace.serve_app("ours", configs, shared=True)
    assert shared["args"]["shared_replicas"] is True
    assert [(d["name"], d["num_replicas"]) for d in shared["deployments"]] == [("DiffusionModelGroup", 2)]
    per_model = bench_trace.serve_app("ours", configs)
    assert "shared_replicas" not in per_model["args"]
    assert [(d["name"], d["num_replicas"]) for d in per_model["deployments"]] == [
        ("DiffusionModel_m0", 2), ("DiffusionModel_m1", 2), ("DiffusionModel_m2", 2)]


def test_only_the_strongest_baseline_bounds_its_queue():
    assert bench_trace.queue_bound("strongest", 4) == 4
    assert bench_trace.queue_bound("production", 4) == -1
    assert bench_trace.serve_app("strongest", [], strongest_queue=3)["args"]["max_queued_requests"] == 3
    assert bench_trace.serve_app("production", [], strongest_queue=3)["args"]["max_queued_requests"] == -1


class _Blocking:
    """A baseline whose generations finish when the test says."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def generate(self, params):
        self.started += 1
        await self.release.wait()
        return params


def test_the_serial_backend_refuses_past_its_queue_bound_and_serves_the_queued_in_turn():
    from benchmarks.vanilla import SerialBackend
    from serving.common.errors import APIError

    async def scenario():
        baseline = _Blocking()
        backend = SerialBackend(baseline, max_queued=1)
        running = asyncio.create_task(backend.generate("first"))
        await asyncio.sleep(0)
        queued = asyncio.create_task(backend.generate("second"))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as refused:
            await backend.generate("third")
        assert refused.value.status_code == 503 and refused.value.code == "overloaded" and baseline.started == 1
        baseline.release.set()
        assert [await running, await queued] == ["first", "second"]
        assert await backend.generate("fourth") == "fourth"  # the queue drained: admitted again

    asyncio.run(scenario())
