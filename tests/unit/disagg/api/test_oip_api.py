"""OIP v2 HTTP API over fake backends (no model, no Ray): the DLRM's signature and a user model's, JSON and binary
bodies, limits, errors."""

import json
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient

from disagg.api.codec import encode_infer_request
from disagg.api.server import create_oip_api
from disagg.config import DLRMAppConfig
from tests.helpers.oip_fakes import (
    ITEMS,
    MAX_BODY_BYTES,
    MAX_IDS,
    MAX_ROWS,
    FailingBackend,
    FakeBackend,
    UserModelBackend,
    app_config,
    binary_body,
    expected_scores,
    expected_user_outputs,
)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> TestClient:
    return TestClient(create_oip_api(backend, app_config()))


def inputs(rows: int = 4, seed: int = 0, ids: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random dense rows and ids (< 3, valid in every table): [rows, 26], or [rows, 26, ids] with -1 holes."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, 13, generator=generator)
    if ids is None:
        return dense, torch.randint(0, 3, (rows, 26), generator=generator)
    return dense, torch.randint(-1, 3, (rows, 26, ids), generator=generator)


def dlrm_request(dense: torch.Tensor, sparse: torch.Tensor, request_id: str | None = None) -> dict[str, Any]:
    request = encode_infer_request({"dense_features": dense, "sparse_features": sparse}, request_id=request_id)
    return request.model_dump(exclude_none=True)


def body(rows: int = 4, request_id: str | None = "req-7") -> dict[str, Any]:
    return dlrm_request(*inputs(rows), request_id=request_id)


def post_raw(client: TestClient, path: str, content: str | bytes):
    return client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", ["/models/ctr/infer", "/models/ctr/versions/1/infer"])
def test_infer_returns_the_backends_output(client: TestClient, backend: FakeBackend, path: str) -> None:
    response = client.post(path, json=body(rows=4))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert (payload["model_name"], payload["model_version"], payload["id"]) == ("ctr", "1", "req-7")
    [output] = payload["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("probabilities", "FP32", [4, 1])
    dense, sparse = inputs(rows=4)
    np.testing.assert_allclose(output["data"], expected_scores(dense.numpy(), sparse.numpy()).ravel(), rtol=1e-6)
    [seen] = backend.calls
    assert torch.equal(seen["dense"], dense) and torch.equal(seen["sparse"], sparse.unsqueeze(2))


def test_multi_hot_json_request_reaches_the_backend_as_bags(client: TestClient, backend: FakeBackend) -> None:
    dense, sparse = inputs(rows=3, ids=5)
    response = client.post("/models/ctr/infer", json=dlrm_request(dense, sparse))
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(
        response.json()["outputs"][0]["data"], expected_scores(dense.numpy(), sparse.numpy()).ravel(), rtol=1e-6
    )
    assert torch.equal(backend.calls[0]["sparse"], sparse)


def post_binary(client: TestClient, request: dict[str, Any], arrays: dict[str, np.ndarray]):
    content, length = binary_body(request, arrays)
    return client.post(
        "/models/ctr/infer",
        content=content,
        headers={"Inference-Header-Content-Length": length, "content-type": "application/octet-stream"},
    )


def binary_request(rows: int = 3, ids: int = 4, **fields: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """An infer request whose two inputs travel as binary data: FP32 dense and INT32 multi-hot ids."""
    dense, sparse = inputs(rows=rows, ids=ids)
    request = {"id": "b-1", **fields, "inputs": [
        {"name": "dense_features", "shape": list(dense.shape), "datatype": "FP32"},
        {"name": "sparse_features", "shape": list(sparse.shape), "datatype": "INT32"},
    ]}  # fmt: skip
    return request, {"dense_features": dense.numpy(), "sparse_features": sparse.numpy().astype(np.int32)}


def test_binary_inputs_get_a_json_response_unless_binary_output_is_asked(
    client: TestClient, backend: FakeBackend
) -> None:
    request, arrays = binary_request()
    response = post_binary(client, request, arrays)
    assert response.status_code == 200, response.text
    assert "inference-header-content-length" not in response.headers
    [output] = response.json()["outputs"]
    np.testing.assert_allclose(output["data"], expected_scores(*arrays.values()).ravel(), rtol=1e-6)
    [seen] = backend.calls
    assert seen["sparse"].dtype == torch.int64 and seen["sparse"].shape == (3, 26, 4)
    assert np.array_equal(seen["sparse"].numpy(), arrays["sparse_features"])
    assert np.array_equal(seen["dense"].numpy(), arrays["dense_features"])


@pytest.mark.parametrize(
    "fields",
    [
        {"parameters": {"binary_data_output": True}},
        {"outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}]},
    ],
    ids=["binary_data_output", "output binary_data"],
)
def test_binary_output_follows_the_json_header(client: TestClient, fields: dict[str, Any]) -> None:
    request, arrays = binary_request(rows=5, **fields)
    response = post_binary(client, request, arrays)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["inference-header-content-length"])
    header = json.loads(response.content[:length])
    [output] = header["outputs"]
    assert output["parameters"] == {"binary_data_size": 20} and "data" not in output
    assert header["id"] == "b-1" and output["shape"] == [5, 1]
    scores = np.frombuffer(response.content[length:], "<f4").reshape(5, 1)
    np.testing.assert_allclose(scores, expected_scores(*arrays.values()), rtol=1e-6)


def test_bad_binary_body_is_400_and_never_reaches_the_backend(client: TestClient, backend: FakeBackend) -> None:
    request, arrays = binary_request()
    content, length = binary_body(request, arrays)
    response = client.post(
        "/models/ctr/infer", content=content[:-1], headers={"Inference-Header-Content-Length": length}
    )
    assert response.status_code == 400
    assert response.json()["error"].startswith("body: inputs declare ")
    response = client.post("/models/ctr/infer", content=content, headers={"Inference-Header-Content-Length": "9999"})
    assert response.json()["error"].startswith("Inference-Header-Content-Length: JSON header of 9999 bytes")
    assert backend.calls == []


def test_binary_ids_are_range_checked_like_json_ones(client: TestClient) -> None:
    request, arrays = binary_request()
    arrays["sparse_features"][1, 7, 2] = -3
    response = post_binary(client, request, arrays)
    assert response.status_code == 400
    assert response.json()["error"].startswith(
        "inputs[1].data: id -3 in row 1, position [7, 2] is out of range for table embeddings.7"
    )


def test_too_many_ids_per_feature_is_400(client: TestClient) -> None:
    request, arrays = binary_request(ids=MAX_IDS + 1)
    response = post_binary(client, request, arrays)
    assert response.status_code == 400
    assert response.json()["error"] == (
        f"inputs[1].shape: sparse_features has 9 values along dimension 2, over the limit of {MAX_IDS} per variable "
        "dimension"
    )


def test_oversized_binary_body_is_413(client: TestClient, backend: FakeBackend) -> None:
    rows = MAX_BODY_BYTES // (26 * MAX_IDS * 4) + 1  # the binary part alone is over the limit
    request, arrays = binary_request(rows=rows, ids=MAX_IDS)
    response = post_binary(client, request, arrays)
    assert response.status_code == 413
    assert backend.calls == []


def test_response_omits_absent_optional_fields(client: TestClient) -> None:
    payload = client.post("/models/ctr/infer", json=body(request_id=None)).json()
    assert "id" not in payload and "parameters" not in payload


def test_server_metadata_and_health(client: TestClient) -> None:
    server = client.get("/").json()
    assert server["name"] == "swiftserve"
    assert isinstance(server["version"], str) and server["extensions"] == ["binary_tensor_data"]
    assert client.get("/health/live").json() == {"live": True}
    assert client.get("/health/ready").json() == {"ready": True}
    assert client.get("/models/ctr/ready").json() == {"name": "ctr", "ready": True}
    assert client.get("/models/ctr/versions/1/ready").status_code == 200


def test_not_ready_backend_makes_readiness_routes_503(client: TestClient, backend: FakeBackend) -> None:
    backend.is_ready = False  # e.g. an embedding shard with no replica
    assert client.get("/health/live").status_code == 200
    response = client.get("/health/ready")
    assert (response.status_code, response.json()) == (503, {"ready": False})
    assert client.get("/models/ctr/ready").status_code == 503
    backend.is_ready = True
    assert client.get("/models/ctr/versions/1/ready").json() == {"name": "ctr", "ready": True}


def test_model_metadata(client: TestClient) -> None:
    metadata = client.get("/models/ctr").json()
    assert metadata["name"] == "ctr" and metadata["versions"] == ["1"]
    assert {t["name"]: t["shape"] for t in metadata["inputs"]} == {
        "dense_features": [-1, 13],
        "sparse_features": [-1, 26, -1],
    }
    assert metadata["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 1]}]
    assert client.get("/models/ctr/versions/1").json() == metadata


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/models/dlrm"),
        ("get", "/models/dlrm/ready"),
        ("post", "/models/dlrm/infer"),
        ("post", "/models/ctr/versions/2/infer"),
        ("get", "/models/ctr/versions/2"),
    ],
)
def test_unknown_model_or_version_is_404(client: TestClient, backend: FakeBackend, method: str, path: str) -> None:
    response = client.request(method, path, json=body() if method == "post" else None)
    assert response.status_code == 404
    assert set(response.json()) == {"error"}
    assert "not found" in response.json()["error"] or "no version '2'" in response.json()["error"]
    assert backend.calls == []


def test_malformed_json_is_400_naming_the_body(client: TestClient) -> None:
    response = post_raw(client, "/models/ctr/infer", '{"inputs": [')
    assert response.status_code == 400
    assert response.json()["error"].startswith("request body is not valid JSON")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("datatype", None, "inputs[0].datatype: field required"),
        ("shape", "13", "inputs[0].shape: "),
        ("shape", [4, -13], "inputs[0].shape[1]: "),
        ("datatype", "FLOAT", "inputs[0].datatype: "),
        ("data", {"values": []}, "inputs[0].data: "),
        ("colour", "red", "inputs[0].colour: unknown field"),
        ("shape", [True, 13], "inputs[0].shape[0]: "),  # JSON types as the schema states them
    ],
)
def test_schema_violations_are_400_naming_the_field(
    client: TestClient, backend: FakeBackend, field: str, value: Any, message: str
) -> None:
    request = body()
    if value is None:
        del request["inputs"][0][field]
    else:
        request["inputs"][0][field] = value
    response = client.post("/models/ctr/infer", json=request)
    assert response.status_code == 400
    assert response.json()["error"].startswith(message), response.json()
    assert backend.calls == []


def test_empty_inputs_list_is_400(client: TestClient) -> None:
    response = client.post("/models/ctr/infer", json={"inputs": []})
    assert response.status_code == 400
    assert response.json()["error"].startswith("inputs: ")


def test_out_of_range_id_is_400_and_never_reaches_the_model(client: TestClient, backend: FakeBackend) -> None:
    request = body()
    request["inputs"][1]["data"][26 * 2 + 5] = 10**6
    response = client.post("/models/ctr/infer", json=request)
    assert response.status_code == 400
    assert "id 1000000 in row 2, position 5 is out of range for table embeddings.5" in response.json()["error"]
    assert backend.calls == []
    assert client.post("/models/ctr/infer", json=body()).status_code == 200  # the server keeps serving


def test_non_finite_dense_value_is_400(client: TestClient) -> None:
    request = body()
    request["inputs"][0]["data"][0] = float("nan")
    response = post_raw(client, "/models/ctr/infer", json.dumps(request))  # Python's json writes NaN
    assert response.status_code == 400
    assert response.json()["error"].startswith("inputs[0].data: dense_features value nan")


def test_too_many_rows_is_413(client: TestClient) -> None:
    response = client.post("/models/ctr/infer", json=body(rows=MAX_ROWS + 1))
    assert response.status_code == 413
    assert f"exceed the limit of {MAX_ROWS} rows" in response.json()["error"]


def test_oversized_body_is_413(client: TestClient, backend: FakeBackend) -> None:
    request = body() | {"parameters": {"padding": "x" * MAX_BODY_BYTES}}
    response = client.post("/models/ctr/infer", json=request)
    assert response.status_code == 413
    assert response.json() == {"error": f"request body exceeds {MAX_BODY_BYTES} bytes"}
    assert backend.calls == []


def test_oversized_chunked_body_is_413(client: TestClient, backend: FakeBackend) -> None:
    chunks = iter([b'{"inputs": [], "id": "', b"x" * MAX_BODY_BYTES, b'"}'])  # no Content-Length: read up to the cap
    response = client.post("/models/ctr/infer", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"error": f"request body exceeds {MAX_BODY_BYTES} bytes"}
    assert backend.calls == []


DEPTH = 100_000
NESTED = "[" * DEPTH + "]" * DEPTH


def nested_bodies() -> dict[str, tuple[bytes, dict[str, str]]]:
    """Bodies nesting 100,000 levels deep, where a value of each kind goes (and as a binary request's header)."""
    valid = json.dumps(body())
    json_bodies = {
        "arrays": NESTED,
        "objects": '{"a":' * DEPTH + "1" + "}" * DEPTH,
        "unclosed": "[" * DEPTH,
        "in a string field": valid.replace('"req-7"', NESTED),
        "in parameters": valid.replace('"id"', f'"parameters": {{"x": {NESTED}}}, "id"'),
        "in tensor data": valid.replace('"data": [', f'"data": [{NESTED}, ', 1),
    }
    bodies = {name: (text.encode(), {}) for name, text in json_bodies.items()}
    header = json_bodies["in tensor data"].encode()
    bodies["binary request header"] = (header + b"\0" * 8, {"Inference-Header-Content-Length": str(len(header))})
    return bodies


@pytest.mark.parametrize("path", ["/models/ctr/infer", "/models/ctr/versions/1/infer"])
@pytest.mark.parametrize(("content", "headers"), nested_bodies().values(), ids=nested_bodies().keys())
def test_deeply_nested_json_is_400_naming_the_body_at_the_depth_limit(
    backend: FakeBackend, path: str, content: bytes, headers: dict[str, str]
) -> None:
    client = TestClient(create_oip_api(backend, DLRMAppConfig(model_name="ctr")))  # room for the 200 kB bodies
    response = client.post(path, content=content, headers={"content-type": "application/json", **headers})
    assert response.status_code == 400
    assert response.json()["error"].startswith("request body is not valid JSON: recursion limit exceeded")
    assert backend.calls == []
    assert client.post(path, json=body()).status_code == 200


def test_nested_data_within_the_parsers_depth_is_400_naming_the_data(client: TestClient) -> None:
    request = body()
    request["inputs"][0]["data"] = json.loads("[" * 150 + "1" + "]" * 150)
    response = client.post("/models/ctr/infer", json=request)
    assert response.status_code == 400
    assert response.json()["error"].startswith("inputs[0].data: ")


def test_backend_failure_is_500_without_internal_details() -> None:
    client = TestClient(create_oip_api(FailingBackend(), app_config()), raise_server_exceptions=False)
    response = client.post("/models/ctr/infer", json=body())
    assert response.status_code == 500
    assert response.json() == {"error": "internal server error"}


@pytest.mark.parametrize("path", ["/models/{model_name}/infer", "/models/{model_name}/versions/{model_version}/infer"])
def test_openapi_documents_the_infer_request_schema(client: TestClient, path: str) -> None:
    schema = client.get("/openapi.json").json()
    operation = schema["paths"][path]["post"]
    content = operation["requestBody"]["content"]
    assert content["application/json"]["schema"]["$ref"] == "#/components/schemas/InferRequest"
    assert "application/octet-stream" in content and "Inference-Header-Content-Length" in operation["description"]
    schemas = schema["components"]["schemas"]
    assert schemas["InferRequest"]["required"] == ["inputs"]
    assert schemas["InferRequest"]["properties"]["outputs"]["anyOf"][0]["items"]["$ref"].endswith("/RequestedOutput")
    assert "FP32" in json.dumps(schemas["InferTensor"]) and "binary_data_size" in json.dumps(schemas["InferTensor"])
    refs = {ref.split("/")[-1] for ref in _refs(schema)}
    assert refs <= set(schemas), refs - set(schemas)


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "with-key"])
def test_openapi_documents_each_routes_statuses_in_oip_error_shape(
    client: TestClient, keyed_client: TestClient, keyed: bool
) -> None:
    schema = (keyed_client if keyed else client).get("/openapi.json").json()
    unauthorized = {"401"} if keyed else set()
    operations = {
        (method, path): operation for path, methods in schema["paths"].items() for method, operation in methods.items()
    }
    metadata, readiness = {"200", "404"} | unauthorized, {"200", "404", "503"} | unauthorized
    infer = {"200", "400", "404", "413", "503"} | unauthorized
    assert {route: set(operation["responses"]) for route, operation in operations.items()} == {
        ("get", "/"): {"200"} | unauthorized,
        ("get", "/health/live"): {"200"},
        ("get", "/health/ready"): {"200", "503"},
        ("get", "/models/{model_name}"): metadata,
        ("get", "/models/{model_name}/versions/{model_version}"): metadata,
        ("get", "/models/{model_name}/ready"): readiness,
        ("get", "/models/{model_name}/versions/{model_version}/ready"): readiness,
        ("post", "/models/{model_name}/infer"): infer,
        ("post", "/models/{model_name}/versions/{model_version}/infer"): infer,
    }
    responses = operations["post", "/models/{model_name}/versions/{model_version}/infer"]["responses"]
    assert set(responses["200"]["content"]) == {"application/json", "application/octet-stream"}
    for status in infer - {"200"}:
        assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert responses["503"]["headers"]["Retry-After"]["required"] is True
    ready = operations["get", "/models/{model_name}/ready"]["responses"]["503"]
    assert ready["content"]["application/json"]["schema"]["$ref"].endswith("/ModelReady")
    parameters = operations["get", "/models/{model_name}/versions/{model_version}"]["parameters"]
    assert {p["name"]: p["schema"]["enum"] for p in parameters} == {"model_name": ["ctr"], "model_version": ["1"]}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_openapi_infer_examples_work(client: TestClient) -> None:
    operation = client.get("/openapi.json").json()["paths"]["/models/{model_name}/infer"]["post"]
    examples = operation["requestBody"]["content"]["application/json"]["examples"]
    responses = {name: client.post("/models/ctr/infer", json=example["value"]) for name, example in examples.items()}
    assert {name: (response.status_code, response.headers["content-type"]) for name, response in responses.items()} == {
        "one_row": (200, "application/json"),
        "binary_outputs": (200, "application/octet-stream"),
    }


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [node["$ref"]] if "$ref" in node else [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


# --- optional API-key auth (serving.common.auth) -------------------------------------------------------------

API_KEY = "oip-test-key-3b9e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROTECTED = [
    ("post", "/models/ctr/infer"),
    ("post", "/models/ctr/versions/1/infer"),
    ("get", "/models/ctr"),
    ("get", "/models/ctr/versions/1"),
    ("get", "/models/ctr/ready"),
    ("get", "/models/ctr/versions/1/ready"),
    ("get", "/"),
    ("get", ""),
]


@pytest.fixture
def keyed_client(backend: FakeBackend) -> TestClient:
    return TestClient(create_oip_api(backend, app_config(), api_key=API_KEY))


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer"}],
    ids=["none", "wrong-key", "basic", "empty"],
)
@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_without_the_key_protected_routes_are_401_in_oip_shape(
    keyed_client: TestClient, backend: FakeBackend, method: str, path: str, headers: dict[str, str]
) -> None:
    response = keyed_client.request(method, path, headers=headers, json=body() if method == "post" else None)
    assert response.status_code == 401
    assert set(response.json()) == {"error"} and isinstance(response.json()["error"], str)
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert API_KEY not in response.text
    assert backend.calls == []


def test_wrong_key_gets_the_invalid_token_challenge(keyed_client: TestClient) -> None:
    assert keyed_client.get("/models/ctr").headers["www-authenticate"] == "Bearer"
    wrong = keyed_client.get("/models/ctr", headers={"Authorization": "Bearer wrong"})
    assert wrong.headers["www-authenticate"] == 'Bearer error="invalid_token"'
    assert wrong.json() == {"error": "invalid API key"}


def test_with_the_key_routes_answer_as_usual(keyed_client: TestClient, client: TestClient) -> None:
    for path in ("/models/ctr/infer", "/models/ctr/versions/1/infer"):
        keyed = keyed_client.post(path, json=body(rows=3), headers=AUTH)
        assert keyed.status_code == 200, keyed.text
        assert keyed.json() == client.post(path, json=body(rows=3)).json()
    for path in ("/", "/models/ctr", "/models/ctr/versions/1", "/models/ctr/ready", "/models/ctr/versions/1/ready"):
        assert keyed_client.get(path, headers=AUTH).json() == client.get(path).json(), path
    dense, sparse = inputs(rows=2)
    request = dlrm_request(dense, sparse)
    content, length = binary_body(request, {"dense_features": dense.numpy()})
    binary = keyed_client.post(
        "/models/ctr/infer", content=content, headers={**AUTH, "Inference-Header-Content-Length": length}
    )
    assert binary.status_code == 200, binary.text
    assert keyed_client.get("/models/nope", headers=AUTH).status_code == 404


def test_health_probes_need_no_key(keyed_client: TestClient, backend: FakeBackend) -> None:
    assert keyed_client.get("/health/live").json() == {"live": True}
    assert keyed_client.get("/health/ready").json() == {"ready": True}
    backend.is_ready = False
    assert keyed_client.get("/health/ready").status_code == 503
    assert keyed_client.get("/openapi.json").status_code == 200


def test_every_route_but_the_probes_and_docs_needs_the_key(keyed_client: TestClient) -> None:
    open_paths = {"/health/live", "/health/ready", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    routes = list(iter_route_contexts(keyed_client.app.routes))  # the app's own routes and those of its routers
    assert set(keyed_client.app.openapi()["paths"]) <= {route.path for route in routes}
    for route in routes:
        path = route.path.replace("{model_name}", "ctr").replace("{model_version}", "1")
        for method in (route.methods or set()) - {"HEAD"}:
            status = keyed_client.request(method, path).status_code
            assert (status == 401) == (route.path not in open_paths), (method, route.path, status)


def test_openapi_documents_the_bearer_scheme_only_when_a_key_is_set(keyed_client: TestClient, client: TestClient):
    keyed = keyed_client.get("/openapi.json").json()
    assert keyed["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "security" in keyed["paths"]["/models/{model_name}/infer"]["post"]
    assert "security" not in keyed["paths"]["/health/ready"]["get"]
    assert "securitySchemes" not in client.get("/openapi.json").json()["components"]


# --- a user model's signature: user INT64 [-1], history INT64 [-1, -1] -> score [-1, 1], embedding [-1, 8] ---------

USERS_SEEN = np.array([3, 0, 99])
HISTORY = np.array([[1, 2, 3, 4], [0, 0, 0, 0], [ITEMS - 1, 7, 0, 5]])


@pytest.fixture
def user_backend() -> UserModelBackend:
    return UserModelBackend()


@pytest.fixture
def user_client(user_backend: UserModelBackend) -> TestClient:
    return TestClient(create_oip_api(user_backend, app_config()))


def user_request(history: np.ndarray = HISTORY, **fields: Any) -> dict[str, Any]:
    tensors = {"user": torch.from_numpy(USERS_SEEN), "history": torch.from_numpy(history)}
    return encode_infer_request(tensors, request_id="u-1").model_dump(exclude_none=True) | fields


def test_user_model_metadata_is_its_signature(user_client: TestClient) -> None:
    metadata = user_client.get("/models/ctr").json()
    assert metadata["inputs"] == [
        {"name": "user", "datatype": "INT64", "shape": [-1]},
        {"name": "history", "datatype": "INT64", "shape": [-1, -1]},
    ]
    assert metadata["outputs"] == [
        {"name": "score", "datatype": "FP32", "shape": [-1, 1]},
        {"name": "embedding", "datatype": "FP32", "shape": [-1, 8]},
    ]
    assert user_client.get("/models/ctr/versions/1").json() == metadata


def test_user_model_json_infer_returns_every_output(user_client: TestClient, user_backend: UserModelBackend) -> None:
    response = user_client.post("/models/ctr/infer", json=user_request())
    assert response.status_code == 200, response.text
    score, embedding = expected_user_outputs(USERS_SEEN, HISTORY)
    assert response.json()["outputs"] == [
        {"name": "score", "datatype": "FP32", "shape": [3, 1], "data": score.ravel().tolist()},
        {"name": "embedding", "datatype": "FP32", "shape": [3, 8], "data": embedding.ravel().tolist()},
    ]
    [seen] = user_backend.calls
    assert list(seen) == ["user", "items"] and np.array_equal(seen["items"].numpy(), HISTORY)


def test_user_model_binary_int32_infer_sends_the_requested_output_only(
    user_client: TestClient, user_backend: UserModelBackend
) -> None:
    request = {"id": "b-1", "inputs": [
        {"name": "history", "shape": [3], "datatype": "INT32"},  # its trailing variable dimension left out: 1
        {"name": "user", "shape": [3], "datatype": "INT32"},
    ], "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}]}  # fmt: skip
    arrays = {"history": HISTORY[:, 0].astype(np.int32), "user": USERS_SEEN.astype(np.int32)}
    content, length = binary_body(request, arrays)
    response = user_client.post("/models/ctr/infer", content=content,
                                headers={"Inference-Header-Content-Length": length})
    assert response.status_code == 200, response.text
    header_length = int(response.headers["inference-header-content-length"])
    [output] = json.loads(response.content[:header_length])["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("embedding", "FP32", [3, 8])
    _, embedding = expected_user_outputs(USERS_SEEN, HISTORY[:, :1])
    assert np.array_equal(np.frombuffer(response.content[header_length:], "<f4").reshape(3, 8), embedding)
    [seen] = user_backend.calls
    assert seen["items"].dtype == torch.int64 and seen["items"].shape == (3, 1)


@pytest.mark.parametrize(
    ("mutate", "status", "message"),
    [
        (lambda r: r["inputs"][1]["data"].__setitem__(9, ITEMS), 400,
         f"inputs[1].data: id {ITEMS} in row 2, position 1 is out of range for table items (valid ids 0..{ITEMS - 1};"),
        (lambda r: r.update(outputs=[{"name": "probabilities"}]), 400,
         "outputs[0].name: unknown output 'probabilities'; this model has 'score' and 'embedding'"),
        (lambda r: r["inputs"][0].update(name="dense_features"), 400,
         "inputs[0].name: unknown input 'dense_features'; expected 'user' and 'history'"),
        (lambda r: r["inputs"][1].update(shape=[3, 2, 2]), 400,
         "inputs[1].shape: history must have shape [-1, -1] or [-1] (-1: any size), got [3, 2, 2]"),
        (lambda r: r["inputs"][0].update(shape=[MAX_ROWS + 1], data=[0] * (MAX_ROWS + 1)), 413,
         f"inputs[0].shape: {MAX_ROWS + 1} rows exceed the limit of {MAX_ROWS} rows per request"),
    ],
    ids=["id out of range", "unknown output", "DLRM input", "rank", "rows"],
)
def test_user_model_refusals_name_the_field(
    user_client: TestClient, user_backend: UserModelBackend, mutate, status: int, message: str
) -> None:
    request = user_request()
    mutate(request)
    response = user_client.post("/models/ctr/infer", json=request)
    assert response.status_code == status
    assert response.json()["error"].startswith(message), response.json()
    assert user_backend.calls == []


@pytest.mark.parametrize(
    ("served", "listed", "absent"),
    [
        ("client", ["`dense_features`: FP32 [-1, 13]", "`sparse_features`: INT64 (or INT32) [-1, 26, -1]",
                    "`probabilities`: FP32 [-1, 1]"], "history"),
        ("user_client", ["`user`: INT64 (or INT32) [-1]", "`history`: INT64 (or INT32) [-1, -1]",
                         "`score`: FP32 [-1, 1]", "`embedding`: FP32 [-1, 8]"], "sparse_features"),
    ],
    ids=["dlrm", "user model"],
)
def test_openapi_describes_the_served_signature_and_its_examples_work(
    request: pytest.FixtureRequest, served: str, listed: list[str], absent: str
) -> None:
    client: TestClient = request.getfixturevalue(served)
    schema = client.get("/openapi.json").json()
    for path in ("/models/{model_name}/infer", "/models/{model_name}/versions/{model_version}/infer"):
        description = schema["paths"][path]["post"]["description"]
        assert all(line in description for line in listed), description
        assert absent not in description
    operation = schema["paths"]["/models/{model_name}/infer"]["post"]
    for example in operation["requestBody"]["content"]["application/json"]["examples"].values():
        response = client.post("/models/ctr/infer", json=example["value"])
        assert response.status_code == 200, response.text
