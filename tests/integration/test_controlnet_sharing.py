"""Base replicas share one ControlNet deployment: its weights live once, in the ControlNet replica only, and every
base replica's ControlNet calls reach it."""

import pytest
from ray import serve

from serving.controlnet.models import build_controlnet_preset
from tests.helpers.images import encode_b64, square
from tests.helpers.replicas import answers_from_replicas
from tests.integration.conftest import DEFAULT_MODEL

pytestmark = pytest.mark.integration

APP = "diffusion-cfg"  # the tiny model alone: two DiffusionModel_tiny replicas, one ControlNet_edges_tiny replica
MODEL, CONTROLNET = f"DiffusionModel_{DEFAULT_MODEL}", f"ControlNet_edges_{DEFAULT_MODEL}"
CFG_WORKER = f"CFGWorker_{DEFAULT_MODEL}"  # sends the unconditional rows' calls
MAX_REQUESTS = 20  # requests sent at most until both base replicas served one (the router spreads them)


def _calls_sent(deployment: str, replicas: int) -> dict[int, int]:
    """Calls to the `edges` ControlNet each replica of ``deployment`` sent so far, by pid."""
    answers = answers_from_replicas(APP, deployment, "controlnet_calls", replicas, key=lambda answer: answer[0])
    return {pid: calls.get("edges", 0) for pid, (_, calls) in answers.items()}


def _calls_served() -> int:
    return serve.get_deployment_handle(CONTROLNET, app_name=APP).calls_served.remote().result(timeout_s=60)


def test_two_base_replicas_hold_no_controlnet_and_one_replica_holds_it_once(http):
    status = serve.status().applications[APP].deployments
    assert status[MODEL].replica_states.get("RUNNING") == 2
    assert status[CONTROLNET].replica_states.get("RUNNING") == 1

    # Requests until both base replicas generated with the ControlNet: each call went to the shared service.
    body = {"prompt": "a square", "size": "64x64", "num_inference_steps": 2, "seed": 3,
            "controlnets": [{"name": "edges", "image": encode_b64(square())}]}
    bases_before, worker_before, served_before = _calls_sent(MODEL, 2), _calls_sent(CFG_WORKER, 1), _calls_served()
    for _ in range(MAX_REQUESTS):
        assert http.post("/cfg/v1/images/generations", json=body).status_code == 200
        bases_after = _calls_sent(MODEL, 2)
        if all(bases_after[pid] > bases_before.get(pid, 0) for pid in bases_after):
            break
    else:
        raise AssertionError(f"a base replica sent no ControlNet call in {MAX_REQUESTS} requests: {bases_after}")
    sent = sum(bases_after[pid] - bases_before.get(pid, 0) for pid in bases_after)
    sent += sum(_calls_sent(CFG_WORKER, 1).values()) - sum(worker_before.values())
    assert _calls_served() - served_before == sent  # every call went to the one service and none elsewhere

    bases = answers_from_replicas(APP, MODEL, "memory_report", 2, key=lambda r: r.pid)
    for report in bases.values():
        assert report.model_bytes.get("UNet2DConditionModel", 0) > 0
        assert "ControlNetModel" not in report.model_bytes, report.model_bytes

    (controlnet,) = answers_from_replicas(APP, CONTROLNET, "memory_report", 1, key=lambda r: r.pid).values()
    expected = build_controlnet_preset("tiny", weights="auto")  # what the deployment serves
    expected_bytes = sum(t.untyped_storage().nbytes() for t in (*expected.parameters(), *expected.buffers()))
    assert controlnet.model_bytes["ControlNetModel"] == expected_bytes
    assert controlnet.pid not in bases
