"""The OpenAI-style HTTP API over a real in-process tiny engine (no Ray)."""

import base64
import io
import json

import pytest
from PIL import Image

from serving.config import DiffusionAppConfig, GenerationDefaults, ImageLimits, LoRAConfig
from tests.helpers.images import encode_b64, square
from tests.helpers.images_api import images_client
from tests.helpers.lora_files import write_lora


@pytest.fixture(scope="module")
def lora_config(tmp_path_factory, fast_config) -> DiffusionAppConfig:
    directory = tmp_path_factory.mktemp("api-loras")
    write_lora(directory / "outlined.safetensors", seed=1, text_encoder=True)
    (directory / "corrupt.safetensors").write_bytes(b"garbage")
    (directory / "pickled.ckpt").write_bytes(b"never opened")
    return fast_config.model_copy(update={"lora": LoRAConfig(directory=directory)})


@pytest.fixture(scope="module")
def client(tiny_engine, lora_config):
    with images_client(tiny_engine, lora_config) as test_client:
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
    assert body["timings"]["total_s"] >= body["timings"]["denoise_s"] > 0
    images = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in body["data"]]
    assert [(image.format, image.size) for image in images] == [("PNG", (32, 48))] * 2


def test_same_seed_gives_same_image_over_http(client):
    body = {"prompt": "a blue square", "seed": 21, "num_inference_steps": 2}
    first = client.post("/v1/images/generations", json=body).json()["data"]
    second = client.post("/v1/images/generations", json=body).json()["data"]
    assert first == second


def test_models_lists_the_served_model(client, tiny_engine):
    """Its LoRAs are those of its directory whose header it can read (``corrupt`` is not listed); its schedulers are
    the engine's."""
    info = tiny_engine.info
    schedulers = {"schedulers": list(info.schedulers)} if info.schedulers else {}
    schedulers |= {"default_scheduler": info.default_scheduler} if info.default_scheduler else {}
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert response.json() == {"object": "list", "data": [
        {"id": "tiny", "object": "model", "created": 0, "owned_by": "swiftserve", "kind": "base-model",
         "family": "sd", "size": "64x64", **schedulers},
        {"id": "edges", "object": "model", "created": 0, "owned_by": "swiftserve", "kind": "controlnet",
         "model": "tiny"},
        {"id": "outlined", "object": "model", "created": 0, "owned_by": "swiftserve", "kind": "lora",
         "model": "tiny"},
    ]}


def test_health_and_openapi(client):
    assert client.get("/health").json() == {"status": "ok"}
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/models", "/health"} <= set(paths)


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "with-key"])
def test_openapi_documents_each_routes_statuses_in_openai_error_shape(client, keyed_client, keyed):
    schema = (keyed_client if keyed else client).get("/openapi.json").json()
    unauthorized = {"401"} if keyed else set()
    responses = {(method, path): operation["responses"]
                 for path, operations in schema["paths"].items() for method, operation in operations.items()}
    assert {route: set(statuses) for route, statuses in responses.items()} == {
        ("post", "/v1/images/generations"): {"200", "400", "404", "413", "422", "503"} | unauthorized,
        ("post", "/v1/images/edits"): {"200", "400", "404", "413", "422", "503"} | unauthorized,
        ("get", "/v1/models"): {"200"} | unauthorized,
        ("get", "/health"): {"200"},
    }
    for path in ("/v1/images/generations", "/v1/images/edits"):
        images = responses["post", path]
        assert set(images["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in {"400", "404", "413", "422", "503"} | unauthorized:
            assert images[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
        assert images["503"]["headers"]["Retry-After"]["required"] is True
        if keyed:
            assert "WWW-Authenticate" in images["401"]["headers"]
    if keyed:
        assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_openapi_request_example_generates(client):
    [example] = client.get("/openapi.json").json()["components"]["schemas"]["ImageGenerationRequest"]["examples"]
    response = client.post("/v1/images/generations", json=example)
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == example["n"]


def test_malformed_json_is_400_naming_the_body(client):
    response = client.post("/v1/images/generations", content=b'{"prompt": "a red',
                           headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert error["param"] == "body" and "JSON" in error["message"]
    assert error["type"] == "invalid_request_error"


DEPTH = 100_000
NESTED_BODIES = {
    "arrays": "[" * DEPTH + "]" * DEPTH,
    "objects": '{"a":' * DEPTH + "1" + "}" * DEPTH,
    "unclosed": "[" * DEPTH,
    "in a string field": '{"prompt": ' + "[" * DEPTH + "]" * DEPTH + "}",
    "in a nested string field": '{"prompt": "x", "loras": [{"name": ' + '{"a":' * DEPTH + "1" + "}" * DEPTH + "}]}",
}


@pytest.mark.parametrize("body", NESTED_BODIES.values(), ids=NESTED_BODIES.keys())
def test_deeply_nested_json_is_400_naming_the_body_at_the_depth_limit(client, body):
    response = client.post("/v1/images/generations", content=body, headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert (error["param"], error["code"]) == ("body", "invalid_json")
    assert error["message"].startswith("request body is not valid JSON: recursion limit exceeded")
    assert client.post("/v1/images/generations", json={"prompt": "still serving"}).status_code == 200


def test_body_that_is_not_utf8_is_400_naming_the_body(client):
    response = client.post("/v1/images/generations", content=b'{"prompt": "\xff\xfe"}',
                           headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert (error["param"], error["code"]) == ("body", "invalid_json")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 1}, "prompt"),
        ({"prompt": "x", "n": "two"}, "n"),
        ({"prompt": ["x"]}, "prompt"),
        ({"prompt": "x", "size": "huge"}, "size"),
        ({"prompt": "x", "n": 99}, "n"),
        ({"prompt": "x", "controlnet": []}, "controlnet"),
        # JSON types as the schema states them: no booleans or strings for numbers
        ({"prompt": "x", "seed": False}, "seed"),
        ({"prompt": "x", "n": True}, "n"),
        ({"prompt": "x", "num_inference_steps": "2"}, "num_inference_steps"),
        ({"prompt": "x", "loras": [{"name": "outlined", "scale": True}]}, "loras[0].scale"),
        ({"prompt": "x", "lora_mode": "eventually"}, "lora_mode"),
    ],
)
def test_bad_fields_are_400_naming_the_field(client, body, param):
    error = _error(client.post("/v1/images/generations", json=body), 400)
    assert error["param"] == param
    assert param in error["message"]


def test_unknown_model_is_404(client):
    error = _error(client.post("/v1/images/generations", json={"prompt": "x", "model": "dall-e-3"}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error["message"] == "model 'dall-e-3' does not exist; served models: 'tiny'"


def test_oversized_body_is_413_and_server_keeps_serving(tiny_engine):
    config = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=1),
                                limits=ImageLimits(max_body_bytes=2048))
    with images_client(tiny_engine, config) as small:
        error = _error(small.post("/v1/images/generations", json={"prompt": "x" * 4096}), 413)
        assert error["param"] == "body"
        chunked = small.post("/v1/images/generations", content=iter([b'{"prompt": "', b"x" * 4096, b'"}']),
                             headers={"content-type": "application/json"})
        assert _error(chunked, 413)["code"] == "body_too_large"
        assert small.post("/v1/images/generations", json={"prompt": "a dot"}).status_code == 200


def test_unknown_route_is_404_in_openai_shape(client):
    assert _error(client.get("/v1/nothing"), 404)["type"] == "invalid_request_error"


def test_lora_request_reports_cache_use_and_step(client):
    body = {"prompt": "a red circle", "seed": 5, "loras": [{"name": "outlined", "scale": 0.9}]}
    first = client.post("/v1/images/generations", json=body)
    assert first.status_code == 200, first.text
    assert first.json()["lora"]["names"] == ["outlined"]
    second = client.post("/v1/images/generations", json=body).json()
    assert second["lora"] == {"names": ["outlined"], "mode": "async", "cache_hits": 1, "applied_at_step": 0,
                              "wait_s": 0.0}
    exact = client.post("/v1/images/generations", json=body | {"lora_mode": "exact"}).json()
    assert exact["lora"]["mode"] == "exact" and exact["data"] == second["data"]
    plain = client.post("/v1/images/generations", json={"prompt": "a red circle", "seed": 5}).json()
    assert plain["lora"] is None and plain["data"] != second["data"]


@pytest.mark.parametrize(
    ("loras", "status", "param"),
    [
        ([{"name": "nope"}], 404, "loras[0].name"),
        ([{"name": "outlined"}, {"name": "../etc/passwd"}], 400, "loras[1].name"),
        ([{"name": "a/b"}], 400, "loras[0].name"),
        ([{"name": ".."}], 400, "loras[0].name"),
        ([{"name": "pickled"}], 404, "loras[0].name"),
        ([{"name": "corrupt"}], 422, "loras[0].name"),
        ([{"name": "outlined"}, {"name": "outlined"}], 400, "loras[1].name"),
        ([{"name": "outlined", "scale": 9}], 400, "loras[0].scale"),
        ([{"name": f"l{i}"} for i in range(5)], 400, "loras"),
        ([{"scale": 1}], 400, "loras[0].name"),
    ],
)
def test_bad_loras_are_refused_naming_the_field(client, loras, status, param):
    error = _error(client.post("/v1/images/generations", json={"prompt": "x", "loras": loras}), status)
    assert error["param"] == param
    if status == 422:
        assert "corrupt" in error["message"]
    assert client.post("/v1/images/generations", json={"prompt": "still serving"}).status_code == 200


def test_official_openai_client_works_unchanged(client):
    from openai import OpenAI

    openai = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    response = openai.images.generate(
        model="tiny", prompt="a red circle", n=2, size="32x32", response_format="b64_json",
        extra_body={"seed": 3, "num_inference_steps": 2, "guidance_scale": 4.0,
                    "loras": [{"name": "outlined", "scale": 0.5}],
                    "controlnets": [{"name": "edges", "image": encode_b64(SQUARE), "preprocess": "canny"}]},
    )
    images = [Image.open(io.BytesIO(base64.b64decode(item.b64_json))) for item in response.data]
    assert [image.size for image in images] == [(32, 32)] * 2
    assert [m.id for m in openai.models.list().data] == ["tiny", "edges", "outlined"]


SQUARE = square()


def test_controlnet_request_changes_the_image_and_resizes_its_input(client):
    body = {"prompt": "a red square", "seed": 7, "size": "32x32"}
    plain = client.post("/v1/images/generations", json=body).json()["data"]
    controlled = client.post("/v1/images/generations", json={
        **body, "controlnets": [{"name": "edges", "image": encode_b64(SQUARE), "conditioning_scale": 1.5,
                                 "preprocess": "canny"}]})
    assert controlled.status_code == 200, controlled.text
    assert controlled.json()["data"] != plain


def _sse(text: str) -> list[tuple[str, dict]]:
    frames = [frame.split("\n") for frame in text.split("\n\n")[:-1]]
    return [(event.removeprefix("event: "), json.loads(data.removeprefix("data: "))) for event, data in frames]


def test_a_streamed_generation_ends_with_the_images_a_plain_request_gives(client):
    body = {"prompt": "a red circle", "n": 2, "size": "32x48", "seed": 11, "num_inference_steps": 4}
    plain = client.post("/v1/images/generations", json=body).json()["data"]
    streamed = client.post("/v1/images/generations", json={**body, "stream": True, "partial_images": 2})
    assert streamed.status_code == 200, streamed.text
    events = _sse(streamed.text)
    previews = [data for name, data in events if name == "image_generation.partial_image"]
    completed = [data for name, data in events if name == "image_generation.completed"]
    assert [name for name, _ in events][-2:] == ["image_generation.completed"] * 2
    assert sorted((p["image_index"], p["partial_image_index"]) for p in previews) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(Image.open(io.BytesIO(base64.b64decode(p["b64_json"]))).size == (32, 48) for p in previews)
    assert [c["b64_json"] for c in completed] == [item["b64_json"] for item in plain]
    assert [c["seed"] for c in completed] == [11, 12]


def test_an_edit_over_the_engine_is_seeded_and_starts_from_the_image(client):
    image = io.BytesIO()
    Image.fromarray(SQUARE).save(image, format="PNG")

    def edit(**data) -> list[str]:
        response = client.post("/v1/images/edits", files=[("image", ("square.png", image.getvalue(), "image/png"))],
                               data={"prompt": "a red square", "seed": "3", "num_inference_steps": "4", **data})
        assert response.status_code == 200, response.text
        return [item["b64_json"] for item in response.json()["data"]]

    light = edit(strength="0.3")
    assert Image.open(io.BytesIO(base64.b64decode(light[0]))).size == (64, 64)
    assert edit(strength="0.3") == light
    assert edit(strength="0.9") != light
    plain = client.post("/v1/images/generations", json={"prompt": "a red square", "seed": 3,
                                                        "num_inference_steps": 4}).json()["data"]
    assert light != [item["b64_json"] for item in plain]


@pytest.mark.parametrize(
    ("controlnet", "status", "param"),
    [
        ({"name": "depth", "image": encode_b64(SQUARE)}, 404, "controlnets[0].name"),
        ({"name": "edges", "image": "%%%"}, 400, "controlnets[0].image"),
        ({"name": "edges", "image": base64.b64encode(b"\x89PNG broken").decode()}, 400, "controlnets[0].image"),
        ({"name": "edges", "image": encode_b64(SQUARE), "conditioning_scale": 99}, 400,
         "controlnets[0].conditioning_scale"),
        ({"name": "edges", "image": encode_b64(SQUARE), "preprocess": "depth"}, 400, "controlnets[0].preprocess"),
        ({"name": "edges"}, 400, "controlnets[0].image"),
    ],
)
def test_bad_controlnets_are_refused_naming_the_field(client, controlnet, status, param):
    error = _error(client.post("/v1/images/generations", json={"prompt": "x", "controlnets": [controlnet]}), status)
    assert error["param"] == param


def test_too_many_controlnets(client):
    item = {"name": "edges", "image": encode_b64(SQUARE)}
    error = _error(client.post("/v1/images/generations", json={"prompt": "x", "controlnets": [item] * 4}), 400)
    assert error["param"] == "controlnets"


# --- optional API-key auth (serving.common.auth) -------------------------------------------------------------

API_KEY = "sk-test-5f0c2d9a"
BAD_AUTH = [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {API_KEY}"},
            {"Authorization": "Bearer "}, {"Authorization": API_KEY}]
PROTECTED = [("post", "/v1/images/generations"), ("get", "/v1/models")]


@pytest.fixture(scope="module")
def keyed_client(tiny_engine, lora_config):
    with images_client(tiny_engine, lora_config, api_key=API_KEY) as test_client:
        yield test_client


@pytest.mark.parametrize("headers", BAD_AUTH, ids=["none", "wrong-key", "basic", "empty", "no-scheme"])
@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_without_the_key_protected_routes_are_401_in_openai_shape(keyed_client, method, path, headers):
    response = keyed_client.request(method, path, headers=headers,
                                    json={"prompt": "x"} if method == "post" else None)
    error = _error(response, 401)
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert API_KEY not in response.text and "sk-wrong" not in response.text


def test_with_the_key_routes_answer_as_usual_and_health_needs_none(keyed_client, client):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    response = keyed_client.post("/v1/images/generations", headers=auth, json={"prompt": "a dot", "size": "32x32"})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 1
    assert keyed_client.get("/v1/models", headers=auth).json() == client.get("/v1/models").json()
    assert keyed_client.get("/health").json() == {"status": "ok"}
    assert keyed_client.get("/openapi.json").status_code == 200
    assert _error(keyed_client.get("/v1/nothing"), 404)["code"] is None  # unknown routes stay 404


def test_every_route_but_health_and_docs_needs_the_key(keyed_client):
    open_paths = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    # The app's own routes (the docs), and those of its routers as OpenAPI lists them: FastAPI >= 0.137 keeps
    # included routes out of `app.routes`.
    routes = {(method, route.path) for route in keyed_client.app.routes
              for method in getattr(route, "methods", set()) - {"HEAD"}}
    routes |= {(method.upper(), path) for path, operations in keyed_client.app.openapi()["paths"].items()
               for method in operations}
    assert {("POST", "/v1/images/generations"), ("POST", "/v1/images/edits"), ("GET", "/v1/models"),
            ("GET", "/health"), ("GET", "/openapi.json")} <= routes
    for method, path in routes:
        status = keyed_client.request(method, path).status_code
        assert (status == 401) == (path not in open_paths), (method, path, status)


def test_official_openai_client_sends_the_key(keyed_client):
    import openai as openai_module
    from openai import OpenAI

    client = OpenAI(base_url=f"{keyed_client.base_url}/v1", api_key=API_KEY, http_client=keyed_client)
    assert client.models.list().data[0].id == "tiny"
    wrong = OpenAI(base_url=f"{keyed_client.base_url}/v1", api_key="sk-wrong", http_client=keyed_client,
                   max_retries=0)
    with pytest.raises(openai_module.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.code == "invalid_api_key"
