"""Base replicas share one ControlNet deployment: its weights live once, in the ControlNet replica only."""

import pytest
from ray import serve

from serving.controlnet.models import build_controlnet_preset
from tests.helpers.images import encode_b64, square
from tests.helpers.replicas import answers_from_replicas
from tests.integration.conftest import DEFAULT_MODEL

pytestmark = pytest.mark.integration

APP = "diffusion-cfg"  # the tiny model alone: two DiffusionModel_tiny replicas, one ControlNet_edges_tiny replica
MODEL, CONTROLNET = f"DiffusionModel_{DEFAULT_MODEL}", f"ControlNet_edges_{DEFAULT_MODEL}"


def test_two_base_replicas_hold_no_controlnet_and_one_replica_holds_it_once(http):
    status = serve.status().applications[APP].deployments
    assert status[MODEL].replica_states.get("RUNNING") == 2
    assert status[CONTROLNET].replica_states.get("RUNNING") == 1

    # Both base replicas generate with the ControlNet: each goes through the shared service.
    body = {"prompt": "a square", "size": "64x64", "num_inference_steps": 2, "seed": 3,
            "controlnets": [{"name": "edges", "image": encode_b64(square())}]}
    for _ in range(4):
        assert http.post("/cfg/v1/images/generations", json=body).status_code == 200

    bases = answers_from_replicas(APP, MODEL, "memory_report", 2, key=lambda r: r.pid)
    for report in bases.values():
        assert report.model_bytes.get("UNet2DConditionModel", 0) > 0
        assert "ControlNetModel" not in report.model_bytes, report.model_bytes

    (controlnet,) = answers_from_replicas(APP, CONTROLNET, "memory_report", 1, key=lambda r: r.pid).values()
    expected = build_controlnet_preset("tiny", weights="auto")  # what the deployment serves
    expected_bytes = sum(t.untyped_storage().nbytes() for t in (*expected.parameters(), *expected.buffers()))
    assert controlnet.model_bytes["ControlNetModel"] == expected_bytes
    assert controlnet.pid not in bases
