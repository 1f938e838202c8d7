"""Base replicas share one ControlNet deployment: its weights live once, in the ControlNet replica only."""

import pytest
from ray import serve

from serving.controlnet.models import build_controlnet_preset
from tests.images import encode_b64, square

pytestmark = pytest.mark.integration

APP = "diffusion-cfg"  # two DiffusionModel replicas, one ControlNet_edges replica


def _reports_by_pid(deployment: str, replicas: int) -> dict[int, object]:
    """Memory reports of ``replicas`` distinct replicas of ``deployment`` (requests spread over them)."""
    handle = serve.get_deployment_handle(deployment, app_name=APP)
    reports = {}
    for _ in range(200):
        report = handle.memory_report.remote().result(timeout_s=60)
        reports[report.pid] = report
        if len(reports) == replicas:
            return reports
    raise AssertionError(f"saw {len(reports)} of {replicas} replicas of {deployment}")


def test_two_base_replicas_hold_no_controlnet_and_one_replica_holds_it_once(http):
    status = serve.status().applications[APP].deployments
    assert status["DiffusionModel"].replica_states.get("RUNNING") == 2
    assert status["ControlNet_edges"].replica_states.get("RUNNING") == 1

    # Both base replicas generate with the ControlNet: each goes through the shared service.
    body = {"prompt": "a square", "size": "64x64", "num_inference_steps": 2, "seed": 3,
            "controlnets": [{"name": "edges", "image": encode_b64(square())}]}
    for _ in range(4):
        assert http.post("/cfg/v1/images/generations", json=body).status_code == 200

    bases = _reports_by_pid("DiffusionModel", replicas=2)
    for report in bases.values():
        assert report.model_bytes.get("UNet2DConditionModel", 0) > 0
        assert "ControlNetModel" not in report.model_bytes, report.model_bytes

    (controlnet,) = _reports_by_pid("ControlNet_edges", replicas=1).values()
    expected = build_controlnet_preset("tiny")
    expected_bytes = sum(t.untyped_storage().nbytes() for t in (*expected.parameters(), *expected.buffers()))
    assert controlnet.model_bytes["ControlNetModel"] == expected_bytes
    assert controlnet.pid not in bases
