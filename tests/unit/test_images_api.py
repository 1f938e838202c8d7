"""The OpenAI-style HTTP API over a real in-process tiny engine (no Ray)."""

import base64
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from serving.api import create_images_api
from serving.config import DiffusionAppConfig, GenerationDefaults, ImageLimits
from serving.engine import LocalBackend


@pytest.fixture(scope="module")
def client(tiny_engine, fast_config):
    with TestClient(create_images_api(LocalBackend(tiny_engine), fast_config)) as test_client:
        yield test_client


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_generation_returns_base64_pngs_of_requested_size(client):
    response = client.post("/v1/images/generations",
                           json={"prompt": "a red circle", "n": 2, "size": "32x48", "seed": 4})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["created"], int) and body["seed"] == 4
    assert body["timings"]["total_s"] >= body["timings"]["inference_s"] > 0
    images = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in body["data"]]
    assert [(image.format, image.size) for image in images] == [("PNG", (32, 48))] * 2


def test_same_seed_gives_same_image_over_http(client):
    body = {"prompt": "a blue square", "seed": 21, "num_inference_steps": 2}
    first = client.post("/v1/images/generations", json=body).json()["data"]
    second = client.post("/v1/images/generations", json=body).json()["data"]
    assert first == second


def test_models_lists_the_served_model(client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert response.json() == {"object": "list", "data": [
        {"id": "tiny", "object": "model", "created": 0, "owned_by": "swiftserve", "kind": "base-model"}]}


def test_health_and_openapi(client):
    assert client.get("/health").json() == {"status": "ok"}
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/images/generations", "/v1/models", "/health"} <= set(paths)


def test_malformed_json_is_400_naming_the_body(client):
    response = client.post("/v1/images/generations", content=b'{"prompt": "a red',
                           headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert error["param"] == "body" and "JSON" in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 1}, "prompt"),
        ({"prompt": "x", "n": "two"}, "n"),
        ({"prompt": ["x"]}, "prompt"),
        ({"prompt": "x", "size": "huge"}, "size"),
        ({"prompt": "x", "n": 99}, "n"),
        ({"prompt": "x", "controlnet": []}, "controlnet"),
    ],
)
def test_bad_fields_are_400_naming_the_field(client, body, param):
    error = _error(client.post("/v1/images/generations", json=body), 400)
    assert error["param"] == param
    assert param in error["message"]


def test_unknown_model_is_404(client):
    error = _error(client.post("/v1/images/generations", json={"prompt": "x", "model": "dall-e-3"}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")


def test_oversized_body_is_413_and_server_keeps_serving(tiny_engine):
    config = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=1),
                                limits=ImageLimits(max_body_bytes=2048))
    with TestClient(create_images_api(LocalBackend(tiny_engine), config)) as small:
        error = _error(small.post("/v1/images/generations", json={"prompt": "x" * 4096}), 413)
        assert error["param"] == "body"
        chunked = small.post("/v1/images/generations", content=iter([b'{"prompt": "', b"x" * 4096, b'"}']),
                             headers={"content-type": "application/json"})
        assert _error(chunked, 413)["code"] == "body_too_large"
        assert small.post("/v1/images/generations", json={"prompt": "a dot"}).status_code == 200


def test_unknown_route_is_404_in_openai_shape(client):
    assert _error(client.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
