"""The open-loop stress client and its rate search, against fake servers behind ``httpx.MockTransport``."""

import asyncio

import httpx
import numpy as np
import pytest

from autoconfig.stress import ClientSettings, SearchSettings, StressClient, arrival_offsets
from autoconfig.workloads import Workload, dlrm_workload, parse_workload_options, workload_for_app
from disagg.api.codec import decode_dlrm_request
from disagg.api.protocol import InferRequest
from disagg.config import DLRMLimits
from disagg.spec import preset_spec
from serving.api.protocol import ImageGenerationRequest

WORKLOAD = Workload("POST", "/models/m/infer", lambda index: f'{{"i": {index}}}'.encode())


class QueueServer:
    """One FIFO server with a fixed service time: latency is the service time below ``capacity_rps`` and grows
    without bound above it."""

    def __init__(self, capacity_rps: float) -> None:
        self.service_s = 1.0 / capacity_rps
        self.free_at = 0.0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        now = asyncio.get_running_loop().time()
        self.free_at = max(now, self.free_at) + self.service_s
        await asyncio.sleep(self.free_at - now)
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


def _search(server, slo_p99_ms: float, search: SearchSettings, on_probe=None, **settings):
    async def run():
        async with _client(server, **settings) as client:
            return await client.find_sustainable_rate(slo_p99_ms, search, on_probe=on_probe)

    return asyncio.run(run())


def _measure(server, rate: float, duration_s: float, slo_p99_ms: float | None = None, **settings):
    async def run():
        async with _client(server, **settings) as client:
            return await client.measure(rate, duration_s, slo_p99_ms=slo_p99_ms)

    return asyncio.run(run())


def test_search_finds_the_rate_where_a_queueing_server_saturates():
    capacity, slo_ms, probe_s = 100.0, 60.0, 0.5  # 10 ms per request; above capacity the queue grows all probe long
    # The p99 request of a probe at rate r waits 0.99 probe_s (r / capacity - 1) in the queue, then 10 ms.
    expected = capacity * (1 + (slo_ms - 10.0) / 1000 / (0.99 * probe_s))
    search = SearchSettings(start_rps=50, probe_s=probe_s, rel_tolerance=0.05, max_probes=20)
    seen = []
    result = _search(QueueServer(capacity), slo_p99_ms=slo_ms, search=search, on_probe=seen.append)
    assert 0.9 * expected <= result.sustainable_rps <= 1.02 * expected
    assert result.stop_reason == "converged"
    assert seen == result.probes
    assert [probe.result.rate for probe in result.probes[:3]] == [50, 100, 200]  # doubled until broken
    assert not result.probes[2].sustainable and result.probes[2].result.p99_ms > slo_ms
    assert result.best.rate == result.sustainable_rps and result.best.p99_ms <= slo_ms
    bad = min(probe.result.rate for probe in result.probes if not probe.sustainable)
    assert (bad - result.sustainable_rps) / result.sustainable_rps <= 0.05  # bisected to the tolerance


def test_a_server_that_always_errors_has_no_sustainable_rate():
    result = _search(_failing, slo_p99_ms=1000.0, search=SearchSettings(start_rps=20, probe_s=0.2))
    assert result.sustainable_rps == 0 and result.best is None
    assert result.stop_reason == "unsustainable"
    [probe] = result.probes
    assert probe.result.completed == 0 and probe.result.errors == 4 and probe.result.p99_ms is None
    assert probe.result.error_rate == 1.0


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
    assert server.open == 0 and len(server.requests) == result.cancelled  # cancelled on the server too


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
    ("search", "rates", "stop_reason"),
    [
        (SearchSettings(start_rps=10, probe_s=0.1, max_probes=3), [10, 20, 40], "max_probes"),
        (SearchSettings(start_rps=10, probe_s=0.1, max_rps=30), [10, 20, 30], "max_rps"),
        (SearchSettings(start_rps=10, probe_s=0.1, max_total_s=0.15), [10], "max_time"),
    ],
)
def test_search_stops_at_its_caps_with_the_last_good_rate(search, rates, stop_reason):
    result = _search(ConcurrencyServer(delay_s=0.0), slo_p99_ms=1000.0, search=search)
    assert [probe.result.rate for probe in result.probes] == rates
    assert result.stop_reason == stop_reason
    assert result.sustainable_rps == rates[-1]


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


def test_measure_refuses_a_non_positive_rate():
    with pytest.raises(ValueError, match="rate"):
        _measure(_failing, rate=0, duration_s=1.0)


def test_workload_bodies_are_valid_requests_of_their_apps():
    dlrm = workload_for_app("disagg.app:build_app", {"model": {"preset": "tiny"}, "model_name": "ctr"})
    assert (dlrm.method, dlrm.path) == ("POST", "/models/ctr/infer")
    inputs = decode_dlrm_request(InferRequest.model_validate_json(dlrm.body(0)), preset_spec("tiny"), DLRMLimits())
    assert inputs.dense.shape[0] == inputs.sparse.shape[0] == 1
    assert dlrm.body(0) != dlrm.body(1) and dlrm.body(0) == dlrm.body(64)  # a pool of 64 distinct bodies
    rows = dlrm_workload(rows_per_request=5).body(0)
    assert (
        decode_dlrm_request(InferRequest.model_validate_json(rows), preset_spec("tiny"), DLRMLimits()).dense.shape[0]
        == 5
    )
    images = workload_for_app("serving.app:build_app", {"model": {"name": "tiny"}})
    assert images.path == "/v1/images/generations"
    request = ImageGenerationRequest.model_validate_json(images.body(3))
    assert (request.model, request.size, request.num_inference_steps, request.seed) == ("tiny", "32x32", 4, 3)
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


def _dlrm_rows(body: bytes, preset: str = "tiny") -> int:
    return decode_dlrm_request(InferRequest.model_validate_json(body), preset_spec(preset), DLRMLimits()).dense.shape[0]


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
    with pytest.raises(ValueError, match=r"workload option 'steps' is not one of dlrm_workload's: .*rows_per_request"):
        workload_for_app("disagg.app:build_app", args, {"rows_per_request": 2, "steps": 4})
    with pytest.raises(ValueError, match="workload option 'rows_per_request' is not one of diffusion_workload's"):
        workload_for_app("serving.app:build_app", {}, {"rows_per_request": 2})
    with pytest.raises(ValueError, match="rows_per_request and pool_size must be >= 1"):
        workload_for_app("disagg.app:build_app", args, {"rows_per_request": 0})


def test_dlrm_workload_of_the_small_preset_addresses_its_larger_tables():
    spec = preset_spec("small")
    assert max(spec.table_sizes) == 100_000 and max(preset_spec("tiny").table_sizes) == 1000
    body = workload_for_app("disagg.app:build_app", {"model": {"preset": "small"}}, {"rows_per_request": 64}).body(0)
    inputs = decode_dlrm_request(InferRequest.model_validate_json(body), spec, DLRMLimits())
    assert inputs.sparse.shape[0] == 64 and int(inputs.sparse.max()) >= 1000
