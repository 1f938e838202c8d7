"""A user model served from its factory and a weights file (the shipped two-tower example), disaggregated and
monolithic, beside the session's applications (deployed first, so these two are only added and deleted): both
answer the model's own outputs, per the signature, over REST and gRPC."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import yaml
from safetensors.torch import save_file

from disagg.examples.two_tower import build
from tests.helpers import REPO
from tests.helpers.serve_apps import deployed_beside

pytestmark = pytest.mark.integration

ROUTES = {"two-tower": "/tt/v2", "two-tower-mono": "/ttmono/v2"}


@pytest.fixture(scope="module")
def model_and_weights(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """The example model with values of its own (seed 7), and its state dict written where every replica reads it."""
    torch.manual_seed(7)
    model = build().eval()
    path = tmp_path_factory.mktemp("two-tower") / "state.safetensors"
    save_file(model.state_dict(), path)
    return model, path


@pytest.fixture(scope="module")
def own_http(base_url, model_and_weights) -> Iterator[httpx.Client]:
    example = yaml.safe_load((REPO / "deploy" / "examples" / "two_tower.yaml").read_text())["applications"][0]
    apps = []
    for name, route in ROUTES.items():
        args = {**example["args"], "serving": "monolithic" if name.endswith("mono") else "disaggregated"}
        args["model"] = {**args["model"], "weights": str(model_and_weights[1])}
        deployments = [{**entry, "ray_actor_options": {"num_cpus": 0}} for entry in example["deployments"]
                       if not name.endswith("mono") or entry["name"] == "DisaggregatedDLRM"]
        if name.endswith("mono"):
            deployments = [{**deployments[0], "name": "MonolithicDLRM"}]
        apps.append({**example, "name": name, "route_prefix": route, "args": args, "deployments": deployments})
    with deployed_beside(apps) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        yield client


def _request(rows: int, history: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"user_id": torch.randint(0, 1000, (rows,), generator=generator),
            "history": torch.randint(0, 2000, (rows, history), generator=generator),
            "item_id": torch.randint(0, 2000, (rows,), generator=generator)}


def _body(inputs: dict[str, torch.Tensor]) -> dict:
    return {"inputs": [{"name": name, "datatype": "INT64", "shape": list(tensor.shape),
                        "data": tensor.reshape(-1).tolist()} for name, tensor in inputs.items()]}


def test_both_layouts_answer_the_models_outputs(own_http, model_and_weights):
    model = model_and_weights[0]
    for rows, history, seed in ((1, 1, 0), (5, 3, 1), (32, 7, 2)):
        inputs = _request(rows, history, seed)
        with torch.inference_mode():
            score, user = model(**inputs)
        for route in ROUTES.values():
            response = own_http.post(f"{route}/models/two_tower/infer", json=_body(inputs))
            assert response.status_code == 200, response.text
            outputs = {output["name"]: output for output in response.json()["outputs"]}
            assert list(outputs) == ["score", "user_embedding"]
            assert outputs["user_embedding"]["shape"] == [rows, 16]
            np.testing.assert_allclose(np.asarray(outputs["score"]["data"]).reshape(rows, 1), score.numpy(),
                                       rtol=0, atol=1e-6)
            np.testing.assert_allclose(np.asarray(outputs["user_embedding"]["data"]).reshape(rows, 16),
                                       user.numpy(), rtol=0, atol=1e-6)


def test_metadata_and_refusals_follow_the_signature(own_http):
    for route in ROUTES.values():
        metadata = own_http.get(f"{route}/models/two_tower").json()
        assert [(t["name"], t["shape"]) for t in metadata["inputs"]] == [
            ("user_id", [-1]), ("history", [-1, -1]), ("item_id", [-1])]
        assert [(t["name"], t["shape"]) for t in metadata["outputs"]] == [("score", [-1, 1]), ("user_embedding",
                                                                                                [-1, 16])]
        inputs = _request(2, 2, 3)
        inputs["item_id"][1] = 2000  # one past the item table
        refused = own_http.post(f"{route}/models/two_tower/infer", json=_body(inputs))
        assert refused.status_code == 400 and "items" in refused.json()["error"], refused.text
        missing = own_http.post(f"{route}/models/two_tower/infer", json=_body({"user_id": inputs["user_id"]}))
        assert missing.status_code == 400 and "history" in missing.json()["error"], missing.text


def test_over_grpc_both_layouts_answer_the_models_outputs(own_http, grpc_port, model_and_weights):
    """OIP over gRPC serves a user model too: the signature's inputs, both outputs in order, equal to the model's."""
    inputs = _request(6, 4, 5)
    with torch.inference_mode():
        expected = [output.numpy() for output in model_and_weights[0](**inputs)]
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        for app in ROUTES:
            sent = []
            for name, tensor in inputs.items():
                sent.append(triton_grpc.InferInput(name, list(tensor.shape), "INT64"))
                sent[-1].set_data_from_numpy(tensor.numpy())
            result = client.infer("two_tower", sent, headers={"application": app})
            assert [output.name for output in result.get_response().outputs] == ["score", "user_embedding"]
            for name, values in zip(("score", "user_embedding"), expected, strict=True):
                np.testing.assert_allclose(result.as_numpy(name), values, rtol=0, atol=1e-6)
    finally:
        client.close()
