"""More load than capacity: the diffusion app admits what its engine can start soon, refuses the rest at once with
503 and ``Retry-After`` in the OpenAI error shape, and the requests it admitted complete and are unharmed; the DLRM
app holds its bounded queue (two batches in the replica, one in Serve's proxy) and refuses the rest at once."""

import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import pytest

from autoconfig.serve_config import load_serve_config
from autoconfig.workloads import Workload, dlrm_workload
from disagg.config import DLRMAppConfig
from disagg.deployments.app import ingress_options
from tests.integration.conftest import DEFAULT_MODEL, REPO

pytestmark = pytest.mark.integration

FLOOD = 48


def _batch_requests() -> int:
    """Requests of the flood's kind (one image, CFG: two rows) that one denoising step of the model they reach (the
    default, `tiny`: they name no `model`) holds."""
    config = load_serve_config(REPO / "deploy" / "serve_config.yaml")
    diffusion = next(app for app in config.applications if app.name == "diffusion")
    model = next(deployment for deployment in diffusion.deployments
                 if deployment.name == f"DiffusionModel_{DEFAULT_MODEL}")
    assert model.num_replicas == 1
    (entry,) = [entry for entry in diffusion.args["models"] if entry["model"]["name"] == DEFAULT_MODEL]
    engine = entry["engine"]
    assert engine["admission_wait_fraction"] < 1  # a request that would wait a whole batch is refused
    return engine["max_batch_rows"] // 2


def _timed_post(base_url: str, body: dict, start: threading.Barrier) -> tuple[httpx.Response, float]:
    with httpx.Client(base_url=base_url, timeout=300) as client:  # one connection per client
        assert client.get("/health").status_code == 200  # the connection is open before the flood starts
        start.wait()  # every request leaves at once: none can finish (and free a slot) before the last arrives
        started = time.monotonic()
        response = client.post("/v1/images/generations", json=body)
        return response, time.monotonic() - started


def test_a_flood_beyond_capacity_is_refused_fast_and_the_admitted_requests_complete(base_url, http):
    probe = {"prompt": "a green triangle", "size": "64x64", "num_inference_steps": 4, "seed": 3}
    before = http.post("/v1/images/generations", json=probe)
    assert before.status_code == 200, before.text

    body = {"prompt": "a red circle", "size": "96x96", "num_inference_steps": 40, "seed": 1}
    start = threading.Barrier(FLOOD)
    with ThreadPoolExecutor(FLOOD) as pool:
        answers = list(pool.map(lambda _: _timed_post(base_url, body, start), range(FLOOD)))
    admitted = [seconds for response, seconds in answers if response.status_code == 200]
    refused = [(response, seconds) for response, seconds in answers if response.status_code != 200]

    batch = _batch_requests()
    # All leave at once, so one batch starts and the engine refuses every later request (it would wait a whole
    # batch); on 2 busy cores the ingress may pass the last ones on only after the first batch finished and
    # freed places: at most one more batch can slip in then.
    assert 1 <= len(admitted) <= 2 * batch, (len(admitted), batch)
    assert len(refused) >= FLOOD - 2 * batch
    for response, _ in refused:
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "overloaded" and error["message"]
    # a refusal does not wait for capacity: most came back before the fastest admitted request finished
    assert statistics.median(seconds for _, seconds in refused) < min(admitted)

    after = http.post("/v1/images/generations", json=probe)
    assert after.status_code == 200, after.text
    assert after.json()["data"] == before.json()["data"]  # the flood left the model and its queues unharmed


DLRM_FLOOD = 600
DLRM_ROWS = 512  # 151 KB of JSON: the replica takes longer over a request than the flood over sending it


async def _dlrm_flood(base_url: str, workload: Workload, count: int) -> list[tuple[int, str | None, float]]:
    """``count`` of the workload's requests posted at once; per answer: status, Retry-After, seconds."""
    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def post(index: int) -> tuple[int, str | None, float]:
            started = time.monotonic()
            async with session.request(workload.method, base_url + workload.path, data=workload.body(index),
                                       headers=dict(workload.headers)) as response:
                await response.read()
                return response.status, response.headers.get("Retry-After"), time.monotonic() - started

        return await asyncio.gather(*(post(index) for index in range(count)))


def test_a_dlrm_flood_fills_the_bounded_queue_and_the_rest_is_refused_at_once(base_url, http):
    config = load_serve_config(REPO / "deploy" / "serve_config.yaml")
    dlrm = next(app for app in config.applications if app.name == "dlrm")
    bound = ingress_options(DLRMAppConfig.model_validate(dlrm.args))
    held = bound["max_ongoing_requests"] + bound["max_queued_requests"]  # one dense replica, one proxy
    assert held < DLRM_FLOOD // 2

    workload = dlrm_workload(rows_per_request=DLRM_ROWS, pool_size=8)
    probe = workload.body(0)
    before = http.post(f"/v2{workload.path}", content=probe, headers=dict(workload.headers))
    assert before.status_code == 200, before.text

    answers = asyncio.run(_dlrm_flood(f"{base_url}/v2", workload, DLRM_FLOOD))
    admitted = [seconds for status, _, seconds in answers if status == 200]
    refused = [(retry_after, seconds) for status, retry_after, seconds in answers if status == 503]
    assert len(admitted) + len(refused) == DLRM_FLOOD, sorted({status for status, _, _ in answers})
    # An unbounded queue would admit all; ours holds `held`, plus what finishes while the flood arrives. Nothing is
    # refused before the proxy's queue is full, and a queued request waits for a slot: it is not refused later.
    assert len(refused) >= DLRM_FLOOD // 4, (len(admitted), len(refused), held)
    assert len(admitted) >= bound["max_queued_requests"], (len(admitted), len(refused), held)
    assert all(retry_after is not None and int(retry_after) >= 1 for retry_after, _ in refused)
    # a refusal does not wait for capacity: it comes back before the median admitted request
    assert statistics.median(seconds for _, seconds in refused) < statistics.median(admitted)

    after = http.post(f"/v2{workload.path}", content=probe, headers=dict(workload.headers))
    assert after.status_code == 200, after.text
    assert after.json()["outputs"] == before.json()["outputs"]  # the flood left the model and its queues unharmed
