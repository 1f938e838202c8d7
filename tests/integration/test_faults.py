"""Replicas killed mid-request (a ControlNet's, the base model's): the requests with work in flight on them get
503 with Retry-After, not a retry or a timeout; Serve replaces the replica and service resumes without any restart
of ours."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray.exceptions import RayActorError

from tests.helpers.controlnet_calls import call_controlnet, preset_controlnet_call
from tests.helpers.images import encode_b64, square
from tests.helpers.replicas import kill_replica, named_replicas, ongoing_requests, running_replicas
from tests.helpers.waiting import first_answer, wait_for
from tests.integration.conftest import DEFAULT_MODEL

pytestmark = pytest.mark.integration

MODEL, CONTROLNET = f"DiffusionModel_{DEFAULT_MODEL}", f"ControlNet_edges_{DEFAULT_MODEL}"  # what requests reach
ACCEPTANCE_GRACE_S = 3.0  # time for a caller to take a replica's acceptance of a call it counts
POLL = {"timeout_s": 60.0, "period_s": 0.05}  # replica state, polled
RECOVERY = {"timeout_s": 180.0, "period_s": 1.0}  # a replacement replica's first answer, polled


def test_killed_controlnet_replica_fails_its_in_flight_request_with_503_then_recovers(http):
    """The `edges` replica is killed while a request's step call is queued on it behind a long direct call
    (`@serve.batch` runs one batch at a time, so that call cannot finish first): the request gets 503 +
    Retry-After naming `controlnets[0].name`, caused by the replica's death (not a timeout); Serve starts a
    replacement, on which the same request then succeeds."""
    body = {"prompt": "a square", "size": "64x64", "num_inference_steps": 2, "seed": 1,
            "controlnets": [{"name": "edges", "image": encode_b64(square())}]}
    (replica,) = named_replicas("diffusion", CONTROLNET)
    assert ongoing_requests(replica) == 0, "the replica is busy before the test"
    long_call = preset_controlnet_call("tiny", rows=64, latent=128)  # tens of seconds of forward on CPU
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(call_controlnet, "diffusion", "edges", long_call, timeout_s=600, model=DEFAULT_MODEL)
        wait_for(lambda: ongoing_requests(replica) == 1, "the long call never reached the replica", held, **POLL)
        request = pool.submit(http.post, "/v1/images/generations", json=body)
        wait_for(lambda: ongoing_requests(replica) == 2, "the request's call never queued on the replica",
                 held, request, **POLL)
        # The replica counts the call, then sends its acceptance; Serve's router retries on another replica a
        # call whose replica dies before the caller took that acceptance. It is sent at once; the grace covers
        # a loaded machine, and the call is still queued behind the long one after it.
        time.sleep(ACCEPTANCE_GRACE_S)
        assert ongoing_requests(replica) == 2 and not held.done() and not request.done(), "the queue drained early"
        kill_replica(replica)
        with pytest.raises(RayActorError):  # still running when killed, so the request's call behind it was too
            held.result(timeout=60)
        response = request.result(timeout=60)
    assert response.status_code == 503, response.text
    assert response.headers.get("retry-after") == "1"
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("controlnet_unavailable", "controlnets[0].name"), error
    assert "ActorDiedError" in error["message"], error  # not the engine's remote_timeout_s

    _answered_after_503s(http, body)
    (replacement,) = running_replicas("diffusion", CONTROLNET)
    assert replacement["name"] != replica["name"]


def _answered_after_503s(http, body: dict):
    """The first 200 answer to ``body`` while a replacement replica starts (503s until then, nothing else)."""
    return first_answer(lambda: http.post("/v1/images/generations", json=body), "no replacement replica answered",
                        **RECOVERY)


def test_killed_base_model_replica_fails_its_requests_with_503_then_recovers(http):
    """Every request running on the killed `DiffusionModel_tiny` replica gets 503 + Retry-After at once (not retried:
    it may be what killed the replica); Serve starts a replacement and the same request then gives the same image."""
    probe = {"prompt": "a blue square", "size": "64x64", "num_inference_steps": 2, "seed": 7}
    before = http.post("/v1/images/generations", json=probe)
    assert before.status_code == 200, before.text
    long = {"prompt": "a red circle", "size": "256x256", "num_inference_steps": 100, "seed": 1}
    (replica,) = named_replicas("diffusion", MODEL)
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(http.post, "/v1/images/generations", json=long) for _ in range(4)]
        # all four on the replica (minutes of denoising at this size) before it is killed
        wait_for(lambda: ongoing_requests(replica) == 4, "the requests never all reached the replica", *running,
                 **POLL)
        kill_replica(replica)
        # each gets its answer from the replica's death, not from a retry that would denoise for minutes
        answered = [future.result(timeout=120) for future in running]
    for response in answered:
        assert response.status_code == 503, response.text
        assert response.headers.get("retry-after") == "1"
        assert response.json()["error"]["code"] == "replica_failed"

    after = _answered_after_503s(http, probe)
    assert named_replicas("diffusion", MODEL) != [replica]
    assert after.json()["data"] == before.json()["data"]  # same seed, same image: nothing shared was damaged

