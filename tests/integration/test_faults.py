"""Replicas killed mid-request (a ControlNet's, the base model's): their requests get 503 with Retry-After or
complete, within a bound; Serve replaces the replica and service resumes without any restart of ours."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from tests.helpers.images import encode_b64, square
from tests.helpers.replicas import kill_replica, named_replicas

pytestmark = pytest.mark.integration


def _controlnet_replica() -> dict:
    """The named actor of the diffusion app's `edges` ControlNet replica (Serve names replicas per app)."""
    replicas = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
                if "ControlNet_edges" in actor["name"] and "diffusion-cfg" not in actor["name"]
                and "diffusion" in actor["name"]]
    assert len(replicas) == 1, replicas
    return replicas[0]


def test_killed_controlnet_replica_fails_or_retries_its_request_then_recovers(http):
    """The in-flight request gets 503 + Retry-After (a call was in flight on the dead replica) or completes (the
    kill fell between two steps' calls and Serve sent the next one to the replacement); it never hangs."""
    body = {"prompt": "a square", "size": "128x128", "num_inference_steps": 40, "seed": 1,
            "controlnets": [{"name": "edges", "image": encode_b64(square())}]}
    replica = _controlnet_replica()
    responses = []
    thread = threading.Thread(target=lambda: responses.append(http.post("/v1/images/generations", json=body)))
    thread.start()
    time.sleep(2.0)  # the request is denoising, calling the ControlNet every step
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    thread.join(timeout=240)
    assert responses, "the request hung"
    assert responses[0].status_code in (200, 503), responses[0].text
    if responses[0].status_code == 503:
        assert responses[0].headers.get("retry-after") == "1"
        assert responses[0].json()["error"]["param"] == "controlnets[0].name"

    deadline = time.monotonic() + 120
    small = {**body, "size": "64x64", "num_inference_steps": 2}
    while True:  # Serve starts a new replica; requests succeed again without any restart of ours
        response = http.post("/v1/images/generations", json=small)
        if response.status_code == 200:
            break
        assert time.monotonic() < deadline, response.text
        time.sleep(1.0)
    assert _controlnet_replica() != replica


def test_killed_base_model_replica_fails_its_requests_with_503_then_recovers(http):
    """Every request running on the killed `DiffusionModel` replica gets 503 + Retry-After at once (not retried:
    it may be what killed the replica); Serve starts a replacement and the same request then gives the same image."""
    probe = {"prompt": "a blue square", "size": "64x64", "num_inference_steps": 2, "seed": 7}
    before = http.post("/v1/images/generations", json=probe)
    assert before.status_code == 200, before.text
    long = {"prompt": "a red circle", "size": "256x256", "num_inference_steps": 100, "seed": 1}
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_timed_post, http, long) for _ in range(4)]
        time.sleep(2.0)  # all four are denoising together: minutes of work at this size
        (replica,) = named_replicas("diffusion", "DiffusionModel")
        assert not any(future.done() for future in running), "requests finished before the kill"
        killed_at = time.monotonic()
        kill_replica(replica)
        answered = [future.result(timeout=120) for future in running]
    for response, finished_at in answered:
        assert response.status_code == 503, response.text
        assert response.headers.get("retry-after") == "1"
        assert response.json()["error"]["code"] == "replica_failed"
        assert finished_at - killed_at < 30.0, "a request outlived its replica by more than 30 s"

    deadline = time.monotonic() + 180
    while (after := http.post("/v1/images/generations", json=probe)).status_code != 200:
        assert after.status_code == 503, after.text
        assert time.monotonic() < deadline, "no replacement replica answered"
        time.sleep(1.0)
    assert named_replicas("diffusion", "DiffusionModel") != [replica]
    assert after.json()["data"] == before.json()["data"]  # same seed, same image: nothing shared was damaged


def _timed_post(http, body: dict):
    response = http.post("/v1/images/generations", json=body)
    return response, time.monotonic()
