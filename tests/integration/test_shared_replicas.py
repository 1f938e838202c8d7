"""`shared_replicas` through Serve: one `DiffusionModelGroup` replica serves two models, each request reaching the
model it names and that model's own ControlNet deployment."""

import pytest
from ray import serve

from tests.helpers.images import encode_b64, square
from tests.integration.conftest import DEFAULT_MODEL, FLUX_MODEL, SDXL_MODEL

pytestmark = pytest.mark.integration

APP = "diffusion-shared"
CONTROLNETS = {DEFAULT_MODEL: "edges", SDXL_MODEL: "edges-xl"}


def _calls_served(model: str) -> int:
    handle = serve.get_deployment_handle(f"ControlNet_{CONTROLNETS[model]}_{model}", app_name=APP)
    return handle.calls_served.remote().result(timeout_s=60)


def test_one_group_replica_serves_each_model_with_its_own_controlnet(http):
    deployments = serve.status().applications[APP].deployments
    assert deployments["DiffusionModelGroup"].replica_states.get("RUNNING") == 1
    assert not [name for name in deployments if name.startswith("DiffusionModel_")]
    cards = {card["id"]: card.get("model") for card in http.get("/shared/v1/models").json()["data"]}
    expected = {DEFAULT_MODEL: None, SDXL_MODEL: None, "edges": DEFAULT_MODEL, "edges-xl": SDXL_MODEL}
    assert expected.items() <= cards.items()  # (and tiny's LoRAs)
    assert FLUX_MODEL not in cards

    images = {}
    for model, controlnet in CONTROLNETS.items():
        before = _calls_served(model)
        response = http.post("/shared/v1/images/generations", json={
            "model": model, "prompt": "a square", "size": "64x64", "num_inference_steps": 2, "seed": 3,
            "response_format": "b64_json", "controlnets": [{"name": controlnet, "image": encode_b64(square())}]})
        assert response.status_code == 200, response.text
        images[model] = response.json()["data"][0]["b64_json"]
        assert _calls_served(model) > before  # this model's ControlNet deployment ran the request's calls
    assert images[DEFAULT_MODEL] != images[SDXL_MODEL]

    absent = http.post("/shared/v1/images/generations", json={"model": FLUX_MODEL, "prompt": "x"})
    assert absent.status_code == 404 and SDXL_MODEL in absent.json()["error"]["message"]
