"""The open-loop stress client and its rate search, against fake servers behind ``httpx.MockTransport``."""

import asyncio

import httpx
import numpy as np
import pytest
import torch

from autoconfig.stress import (
    ClientSettings,
    LoadResult,
    SearchSettings,
    StressClient,
    arrival_offsets,
    is_sustainable,
    late_budget,
)
from autoconfig.workloads import Workload, dlrm_workload, parse_workload_options, workload_for_app
from disagg.api.codec import decode_infer_inputs
from disagg.api.protocol import InferRequest
from disagg.config import DLRMLimits
from disagg.signature import dlrm_signature
from disagg.spec import preset_spec
from serving.api.protocol import ImageGenerationRequest
from serving.controlnet.conditioning import decode_image
from tests.helpers.oip_fakes import dlrm_id_ranges
from tests.helpers.virtual_time import run_in_virtual_time

WORKLOAD = Workload("POST", "/models/m/infer", lambda index: f'{{"i": {index}}}'.encode())


class QueueServer:
    """One FIFO server with a fixed service time: latency is the service time below ``capacity_rps`` and grows
    without bound above it. A request cancelled before its service began gives its slot back, so the backlog of
    a probe stopped early is gone when the next one starts."""

    def __init__(self, capacity_rps: float) -> None:
        self.service_s = 1.0 / capacity_rps
        self.free_at = 0.0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(now, self.free_at)
        self.free_at = start + self.service_s
        try:
            await asyncio.sleep(start + self.service_s - now)
        except asyncio.CancelledError:
            if start > loop.time():
                self.free_at -= self.service_s
            raise
        return httpx.Response(200)


class ConcurrencyServer:
    """Answers after ``delay_s`` (forever by default) and records the most requests it held at once."""

    def __init__(self, delay_s: float = 3600.0) -> None:
        self.delay_s = delay_s
        self.open = 0
        self.most_open = 0
        self.requests: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await asyncio.sleep(self.delay_s)
            return httpx.Response(200)
        finally:
            self.open -= 1


async def _failing(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, json={"error": "overloaded"})


def _client(server, **settings) -> StressClient:
    settings = {"arrivals": "constant"} | settings
    return StressClient("http://fake", WORKLOAD, ClientSettings(**settings), transport=httpx.MockTransport(server))


def _search(server, slo_p99_ms: float, search: SearchSettings, on_probe=None, virtual_time=False, **settings):
    """The search against ``server``; ``virtual_time`` runs it on a loop whose clock skips idle waits (for servers
    timed by the loop's clock; the search's own ``max_total_s`` still counts real time)."""

    async def run():
        async with _client(server, **settings) as client:
            return await client.find_sustainable_rate(slo_p99_ms, search, on_probe=on_probe)

    return run_in_virtual_time(run()) if virtual_time else asyncio.run(run())


def _measure(server, rate: float, duration_s: float, slo_p99_ms: float | None = None, **settings):
    async def run():
        async with _client(server, **settings) as client:
            return await client.measure(rate, duration_s, slo_p99_ms=slo_p99_ms)

    return asyncio.run(run())


def test_search_finds_the_rate_where_a_queueing_server_saturates():
    capacity, slo_ms, service_ms, requests = 100.0, 60.0, 10.0, 60
    # A deciding probe at rate r sends `requests` over requests / r seconds; above capacity its p99 request (the
    # 0.99 * requests-th) waits 0.99 * requests * (1 / capacity - 1 / r) in the queue, then the service time.
    expected = 1 / (1 / capacity - (slo_ms - service_ms) / 1000 / (0.99 * requests))
    search = SearchSettings(start_rps=50, probe_s=0.2, min_requests=requests)  # bisects to 2.5%
    seen = []
    result = _search(QueueServer(capacity), slo_p99_ms=slo_ms, search=search, on_probe=seen.append, virtual_time=True)
    assert 0.95 * expected <= result.sustainable_rps <= 1.02 * expected
    assert result.stop_reason == "converged"
    assert seen == result.probes
    scouts = result.probes[:3]
    assert [probe.result.rate for probe in scouts] == [50, 100, 200]  # doubled with scouts until one broke
    assert not any(probe.deciding for probe in scouts) and not scouts[2].sustainable
    decided = [(probe.result.rate, probe.sustainable, probe.deciding) for probe in result.probes[3:5]]
    assert decided == [(200, False, True), (100, True, True)]  # decided from the top down until a rate held
    assert all(probe.result.planned == requests for probe in result.probes if probe.deciding)
    assert result.best.rate == result.sustainable_rps and result.best.p99_ms <= slo_ms
    assert result.best.planned == requests
    bad = min(probe.result.rate for probe in result.probes if probe.deciding and not probe.sustainable)
    assert (bad - result.sustainable_rps) / result.sustainable_rps <= 0.025  # bisected to the tolerance


class RateSearchDouble:
    """Stands in for the stress client in a rate search: a probe holds up to ``scout_capacity`` rps when it plans
    fewer than ``min_requests`` requests (a scout), up to ``capacity`` when it plans more (a deciding probe)."""

    def __init__(self, capacity: float, scout_capacity: float, min_requests: int) -> None:
        self.capacity, self.scout_capacity, self.min_requests = capacity, scout_capacity, min_requests

    async def measure(self, rate, duration_s, *, slo_p99_ms=None, requests=None) -> LoadResult:
        planned = requests or round(rate * duration_s)
        limit = self.capacity if planned >= self.min_requests else self.scout_capacity
        p99 = 5.0 if rate <= limit else 10 * slo_p99_ms
        return LoadResult(rate=rate, duration_s=duration_s, planned=planned, completed=planned, errors=0,
                          p50_ms=p99 / 2, p99_ms=p99, achieved_rps=rate)


def _search_double(double: RateSearchDouble) -> object:
    from autoconfig.stress import _RateSearch

    search = SearchSettings(start_rps=50, probe_s=1.0, min_requests=double.min_requests)
    return asyncio.run(_RateSearch(double, 50.0, search, None).run())


def test_scouts_bisect_and_deciding_probes_only_confirm_the_bracket_they_leave():
    result = _search_double(RateSearchDouble(capacity=137, scout_capacity=137, min_requests=400))
    assert result.stop_reason == "converged" and 137 * 0.975 <= result.sustainable_rps <= 137
    deciding = [(p.result.rate, p.sustainable) for p in result.probes if p.deciding]
    # The doubling's top two, then the two ends of the bracket the scouts bisected to 2.5%: four in all (bisecting
    # with deciding probes took seven).
    assert deciding[:2] == [(200, False), (100, True)] and len(deciding) == 4
    assert deciding[2][1] and not deciding[3][1] and (deciding[3][0] - deciding[2][0]) / deciding[2][0] <= 0.025


def test_scouts_contradicted_by_a_deciding_probe_leave_the_bisection_to_deciding_probes():
    result = _search_double(RateSearchDouble(capacity=120, scout_capacity=160, min_requests=400))
    assert result.stop_reason == "converged" and 120 * 0.975 <= result.sustainable_rps <= 120
    after = [p for p in result.probes[5:] if p.result.rate < 160]
    first_contradiction = next(i for i, p in enumerate(after) if p.deciding and not p.sustainable)
    assert all(p.deciding for p in after[first_contradiction:])  # no scout is trusted after it
    assert result.best.planned >= 400


class ColdStartServer:
    """Its first ``cold`` requests take ``cold_s``; the others are answered at once."""

    def __init__(self, cold: int, cold_s: float) -> None:
        self.cold, self.cold_s, self.seen = cold, cold_s, 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        if self.seen <= self.cold:
            await asyncio.sleep(self.cold_s)
        return httpx.Response(200)


def test_a_broken_scout_is_decided_again_and_the_doubling_resumes_when_the_rate_holds():
    search = SearchSettings(start_rps=10, probe_s=0.2, min_requests=20, max_rps=40)
    result = _search(ColdStartServer(cold=2, cold_s=0.3), slo_p99_ms=100.0, search=search, virtual_time=True)
    probes = [(probe.result.rate, probe.deciding, probe.sustainable) for probe in result.probes]
    assert probes == [(10, False, False), (10, True, True), (20, False, True), (40, False, True), (40, True, True)]
    assert result.stop_reason == "max_rps" and result.sustainable_rps == 40
    assert result.best.planned == 20 and result.best.completed == 20


def test_a_server_that_always_errors_has_no_sustainable_rate():
    search = SearchSettings(start_rps=20, probe_s=0.2, min_requests=8)
    result = _search(_failing, slo_p99_ms=1000.0, search=search)
    assert result.sustainable_rps == 0 and result.best is None
    assert result.stop_reason == "unsustainable"
    scout, decided = result.probes
    assert not scout.deciding and scout.result.errors == 4  # 0.2 s at 20 rps
    assert decided.deciding and decided.result.errors == decided.result.planned == 8
    assert decided.result.completed == 0 and decided.result.p99_ms is None and decided.result.error_rate == 1.0


def test_in_flight_cap_holds_against_a_dead_server_and_waiting_requests_time_out():
    server = ConcurrencyServer()
    result = _measure(server, rate=100, duration_s=0.3, max_in_flight=4, timeout_s=0.2)
    assert server.most_open == 4
    assert server.open == 0  # every request was cancelled at its deadline
    assert result.completed == 0 and result.errors == 30


def test_latency_counts_from_the_scheduled_time_so_client_side_queueing_shows():
    server = ConcurrencyServer(delay_s=0.05)  # 50 ms each, any concurrency
    result = _measure(server, rate=100, duration_s=0.2, max_in_flight=1, timeout_s=5.0)
    assert result.errors == 0 and result.completed == 20
    assert result.p50_ms < result.p99_ms
    assert result.p99_ms > 500  # the 20th request waited for 19 others, one at a time
    assert result.achieved_rps < 25  # one at a time: at most 20 per second


def test_a_probe_stops_once_more_than_one_percent_of_its_requests_are_late():
    server = ConcurrencyServer()  # never answers: every request becomes late 50 ms after its send time
    result = _measure(server, rate=100, duration_s=10.0, slo_p99_ms=50.0, timeout_s=60.0)
    # 1000 planned, so the 11th late request breaks the SLO: sending stops about 0.16 s in, not after 10 s.
    assert result.stopped_early and 11 <= result.cancelled < 100
    assert result.completed == 0 and result.errors == 0
    assert result.p99_ms > 50.0  # the waits of the cancelled requests: lower bounds of their latency
    # cancelled on the server too; a request whose send time had come may be cancelled before it reached it
    assert server.open == 0 and 11 <= len(server.requests) <= result.cancelled


def test_a_probe_stopped_early_reports_its_answers_per_second_over_the_time_it_ran():
    server = ConcurrencyServer(delay_s=0.06)  # answers, but 10 ms past a 50 ms SLO
    result = _measure(server, rate=100, duration_s=10.0, slo_p99_ms=50.0, timeout_s=60.0)
    assert result.stopped_early and result.completed > 0
    # stopped within a second of a 10 s window: over the window it would read below a tenth of the answers
    assert result.achieved_rps >= result.completed / 1.0


def test_one_request_over_the_late_budget_puts_the_p99_above_the_slo_and_a_stopped_probe_never_holds():
    slo_ms = 50.0
    for planned in range(1, 1001):
        late = late_budget(planned) + 1
        latencies = [0.0] * (planned - late) + [slo_ms + 1] * late
        assert np.percentile(latencies, 99) > slo_ms, planned
    assert [late_budget(n) for n in (10, 60, 200, 1000)] == [1, 1, 2, 10]  # about 1%
    stopped = LoadResult(rate=10, duration_s=1, planned=60, completed=58, errors=0, cancelled=2, p50_ms=5,
                         p99_ms=49, achieved_rps=9, stopped_early=True)
    assert not is_sustainable(stopped, slo_ms, max_error_rate=0.01)
    assert is_sustainable(stopped.model_copy(update={"stopped_early": False}), slo_ms, max_error_rate=0.01)


def test_a_probe_within_the_slo_runs_its_whole_schedule():
    result = _measure(ConcurrencyServer(delay_s=0.0), rate=50, duration_s=0.4, slo_p99_ms=1000.0)
    assert not result.stopped_early and result.completed == 20 and result.cancelled == 0


def test_requests_follow_the_workload_and_the_schedule():
    server = ConcurrencyServer(delay_s=0.0)
    result = _measure(server, rate=50, duration_s=0.2)
    assert result.completed == 10 and result.errors == 0 and result.p50_ms is not None
    assert {(request.method, request.url.path) for request in server.requests} == {("POST", "/models/m/infer")}
    assert [request.content for request in server.requests] == [f'{{"i": {i}}}'.encode() for i in range(10)]


@pytest.mark.parametrize(
    ("search", "rates", "stop_reason", "sustainable"),
    [
        (SearchSettings(start_rps=10, probe_s=0.1, min_requests=2, max_probes=3), [10, 20, 40], "max_probes", 40),
        (SearchSettings(start_rps=10, probe_s=0.1, min_requests=2, max_rps=30), [10, 20, 30], "max_rps", 30),
        # Scouts of one request decide nothing: out of time after the first, nothing is known to hold.
        (SearchSettings(start_rps=10, probe_s=0.1, min_requests=2, max_total_s=0.15), [10], "max_time", 0),
        (SearchSettings(start_rps=10, probe_s=0.1, min_requests=100, max_probes=2), [10, 20], "max_probes", 0),
    ],
)
def test_search_stops_at_its_caps_with_the_highest_decided_rate(search, rates, stop_reason, sustainable):
    result = _search(ConcurrencyServer(delay_s=0.0), slo_p99_ms=1000.0, search=search)
    assert [probe.result.rate for probe in result.probes] == rates
    assert result.stop_reason == stop_reason
    assert result.sustainable_rps == sustainable
    assert (result.best is None) == (sustainable == 0)


def test_a_deciding_probe_sends_its_requests_over_a_window_long_enough_for_them():
    settings = SearchSettings(probe_s=0.5, min_requests=30)
    assert settings.deciding_requests(20) == 30 and settings.deciding_requests(100) == 50  # 0.5 s holds more
    server = ConcurrencyServer(delay_s=0.0)
    result = _measure_requests(server, rate=100, duration_s=0.1, requests=30)
    assert result.planned == result.completed == len(server.requests) == 30
    assert result.duration_s == pytest.approx(0.3)
    with pytest.raises(ValueError, match="requests"):
        _measure_requests(server, rate=100, duration_s=0.1, requests=0)


def _measure_requests(server, rate: float, duration_s: float, requests: int):
    async def run():
        async with _client(server, arrivals="poisson") as client:
            return await client.measure(rate, duration_s, requests=requests)

    return asyncio.run(run())


def test_poisson_arrivals_are_seeded_sorted_and_within_the_window():
    def offsets(seed):
        return arrival_offsets(200.0, 2.0, "poisson", np.random.default_rng(seed))

    first, again, other = offsets(1), offsets(1), offsets(2)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert np.all(np.diff(first) >= 0) and first[0] >= 0 and first[-1] < 2.0
    assert 300 < len(first) < 500  # Poisson(400): 5 standard deviations either side
    constant = arrival_offsets(50.0, 0.2, "constant", np.random.default_rng(0))
    np.testing.assert_allclose(constant, np.arange(10) / 50.0)
    counted = arrival_offsets(200.0, 2.0, "poisson", np.random.default_rng(1), count=123)
    assert len(counted) == 123 and np.all(np.diff(counted) >= 0) and counted[-1] < 2.0
    np.testing.assert_allclose(arrival_offsets(50.0, 0.2, "constant", np.random.default_rng(0), count=4),
                               np.arange(4) / 50.0)


def test_measure_refuses_a_non_positive_rate():
    with pytest.raises(ValueError, match="rate"):
        _measure(_failing, rate=0, duration_s=1.0)


def test_workload_bodies_are_valid_requests_of_their_apps():
    dlrm = workload_for_app("disagg.app:build_app", {"model": {"preset": "tiny"}, "model_name": "ctr"})
    assert (dlrm.method, dlrm.path) == ("POST", "/models/ctr/infer")
    inputs = _dlrm_inputs(dlrm.body(0))
    assert inputs["dense"].shape[0] == inputs["sparse"].shape[0] == 1
    assert dlrm.body(0) != dlrm.body(1) and dlrm.body(0) == dlrm.body(64)  # a pool of 64 distinct bodies
    assert _dlrm_rows(dlrm_workload(rows_per_request=5).body(0)) == 5
    images = workload_for_app("serving.app:build_app", {"model": {"name": "tiny"}})
    assert images.path == "/v1/images/generations"
    request = ImageGenerationRequest.model_validate_json(images.body(3))
    assert (request.model, request.size, request.num_inference_steps, request.seed) == ("tiny", "32x32", 4, 3)
    # Several models: the first (the default), which the shortcuts tune; one left unnamed is called `tiny`.
    models = {"models": [{"model": {"name": "sdxl", "preset": "sdxl-tiny"}}, {"model": {"name": "tiny"}}]}
    for args, model in ((models, "sdxl"), ({"models": [{}]}, "tiny")):
        body = workload_for_app("serving.app:build_multi_app", args).body(0)
        assert ImageGenerationRequest.model_validate_json(body).model == model
    with pytest.raises(ValueError, match="no workload"):
        workload_for_app("other.app:build", {})


def test_workload_options_are_parsed_as_yaml_scalars():
    assert parse_workload_options(None) == parse_workload_options("") == parse_workload_options(" , ") == {}
    assert parse_workload_options("rows_per_request=32, seed=1,size=64x64 ,flag=true,x=0.5") == {
        "rows_per_request": 32,
        "seed": 1,
        "size": "64x64",
        "flag": True,
        "x": 0.5,
    }
    for malformed in ("rows_per_request", "=3", "seed=1,steps"):
        with pytest.raises(ValueError, match="expected KEY=VALUE"):
            parse_workload_options(malformed)


def _dlrm_inputs(body: bytes, preset: str = "tiny") -> dict[str, torch.Tensor]:
    """``body`` decoded as the API decodes a request to the DLRM ``preset``."""
    spec = preset_spec(preset)
    return decode_infer_inputs(InferRequest.model_validate_json(body), dlrm_signature(spec.num_dense, spec.num_tables),
                               dlrm_id_ranges(spec), DLRMLimits())


def _dlrm_rows(body: bytes, preset: str = "tiny") -> int:
    return _dlrm_inputs(body, preset)["dense"].shape[0]


def test_workload_options_change_the_requests_and_unknown_ones_are_named():
    args = {"model": {"preset": "tiny"}, "model_name": "ctr"}
    plain = workload_for_app("disagg.app:build_app", args)
    rows = workload_for_app("disagg.app:build_app", args, parse_workload_options("rows_per_request=32,pool_size=2"))
    assert (_dlrm_rows(plain.body(0)), _dlrm_rows(rows.body(0))) == (1, 32)
    assert rows.path == "/models/ctr/infer" and rows.body(0) == rows.body(2) != rows.body(1)
    reseeded = workload_for_app("disagg.app:build_app", args, {"seed": 1})
    assert reseeded.body(0) != plain.body(0)
    # An option overrides what the app's args imply.
    assert workload_for_app("disagg.app:build_app", args, {"model_name": "other"}).path == "/models/other/infer"
    images = workload_for_app(
        "serving.app:build_app", {"model": {"name": "tiny"}}, parse_workload_options("steps=2,size=64x64,n=2")
    )
    request = ImageGenerationRequest.model_validate_json(images.body(0))
    assert (request.model, request.size, request.num_inference_steps, request.n) == ("tiny", "64x64", 2, 2)
    assert request.controlnets == []
    conditioned = workload_for_app("serving.app:build_app", {}, parse_workload_options("controlnets=edges+depth"))
    controls = ImageGenerationRequest.model_validate_json(conditioned.body(3)).controlnets
    assert [control.name for control in controls] == ["edges", "depth"]
    square = decode_image(controls[0].image, max_bytes=2**20, max_pixels=2**20)
    assert square.shape == (64, 64, 3) and square[32, 32].tolist() == [255] * 3 and square[0, 0].tolist() == [0] * 3
    assert request.loras == []
    mixed = workload_for_app("serving.app:build_app", {}, parse_workload_options("loras=outlined|outlined+dark|"))
    assert [[lora.name for lora in ImageGenerationRequest.model_validate_json(mixed.body(i)).loras] for i in range(4)] \
        == [["outlined"], ["outlined", "dark"], [], ["outlined"]]
    with pytest.raises(ValueError, match=r"workload option 'steps' is not one of dlrm_workload's: .*rows_per_request"):
        workload_for_app("disagg.app:build_app", args, {"rows_per_request": 2, "steps": 4})
    with pytest.raises(ValueError, match="workload option 'rows_per_request' is not one of diffusion_workload's"):
        workload_for_app("serving.app:build_app", {}, {"rows_per_request": 2})
    with pytest.raises(ValueError, match="rows_per_request and pool_size must be >= 1"):
        workload_for_app("disagg.app:build_app", args, {"rows_per_request": 0})


def test_dlrm_workload_of_the_small_preset_addresses_its_larger_tables():
    assert max(preset_spec("small").table_sizes) == 100_000 and max(preset_spec("tiny").table_sizes) == 1000
    body = workload_for_app("disagg.app:build_app", {"model": {"preset": "small"}}, {"rows_per_request": 64}).body(0)
    sparse = _dlrm_inputs(body, "small")["sparse"]
    assert sparse.shape[0] == 64 and int(sparse.max()) >= 1000
