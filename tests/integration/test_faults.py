"""A ControlNet replica killed mid-request: that request gets 503, Serve replaces the replica, service resumes."""

import threading
import time

import pytest
import ray

from tests.images import encode_b64, square

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
