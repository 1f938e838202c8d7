"""OIP v2 HTTP API over an in-process tiny DLRM (no Ray)."""

import json
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from disagg.api import create_oip_api
from disagg.config import DLRMAppConfig, DLRMLimits
from disagg.model import DLRM, DLRMSpec, build_preset
from disagg.protocol import encode_dlrm_request

MAX_BODY_BYTES = 32 * 1024
MAX_ROWS = 16


class InProcessBackend:
    """Runs the model directly and records what reached it."""

    def __init__(self, model: DLRM) -> None:
        self.model = model
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def spec(self) -> DLRMSpec:
        return self.model.spec

    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        self.calls.append((dense, sparse))
        with torch.inference_mode():
            return self.model(dense, sparse)


class FailingBackend(InProcessBackend):
    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("secret internal detail")


@pytest.fixture(scope="module")
def model() -> DLRM:
    return build_preset("tiny").eval()


@pytest.fixture
def backend(model: DLRM) -> InProcessBackend:
    return InProcessBackend(model)


def app_config() -> DLRMAppConfig:
    return DLRMAppConfig(model_name="ctr",
                         limits=DLRMLimits(max_body_bytes=MAX_BODY_BYTES, max_rows_per_request=MAX_ROWS))


@pytest.fixture
def client(backend: InProcessBackend) -> TestClient:
    return TestClient(create_oip_api(backend, app_config()))


def inputs(rows: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, 13, generator=generator)
    sparse = torch.randint(0, 3, (rows, 26), generator=generator)
    return dense, sparse


def body(rows: int = 4, request_id: str | None = "req-7") -> dict[str, Any]:
    return encode_dlrm_request(*inputs(rows), request_id=request_id).model_dump(exclude_none=True)


def post_raw(client: TestClient, path: str, content: str | bytes):
    return client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", ["/models/ctr/infer", "/models/ctr/versions/1/infer"])
def test_infer_returns_the_models_probabilities(client: TestClient, model: DLRM, path: str) -> None:
    response = client.post(path, json=body(rows=4))
    assert response.status_code == 200, response.text
    payload = response.json()
    assert (payload["model_name"], payload["model_version"], payload["id"]) == ("ctr", "1", "req-7")
    [output] = payload["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("probabilities", "FP32", [4, 1])
    with torch.inference_mode():
        expected = model(*inputs(rows=4))
    assert torch.equal(torch.tensor(output["data"], dtype=torch.float32).reshape(4, 1), expected)


def test_response_omits_absent_optional_fields(client: TestClient) -> None:
    payload = client.post("/models/ctr/infer", json=body(request_id=None)).json()
    assert "id" not in payload and "parameters" not in payload


def test_server_metadata_and_health(client: TestClient) -> None:
    server = client.get("/").json()
    assert server["name"] == "swiftserve"
    assert isinstance(server["version"], str) and isinstance(server["extensions"], list)
    assert client.get("/health/live").json() == {"live": True}
    assert client.get("/health/ready").json() == {"ready": True}
    assert client.get("/models/ctr/ready").json() == {"name": "ctr", "ready": True}
    assert client.get("/models/ctr/versions/1/ready").status_code == 200


def test_model_metadata(client: TestClient) -> None:
    metadata = client.get("/models/ctr").json()
    assert metadata["name"] == "ctr" and metadata["versions"] == ["1"]
    assert {t["name"]: t["shape"] for t in metadata["inputs"]} == {
        "dense_features": [-1, 13], "sparse_features": [-1, 26]
    }
    assert metadata["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 1]}]
    assert client.get("/models/ctr/versions/1").json() == metadata


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", "/models/dlrm"), ("get", "/models/dlrm/ready"), ("post", "/models/dlrm/infer"),
     ("post", "/models/ctr/versions/2/infer"), ("get", "/models/ctr/versions/2")],
)
def test_unknown_model_or_version_is_404(client: TestClient, backend: InProcessBackend, method: str,
                                         path: str) -> None:
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
    ],
)
def test_schema_violations_are_400_naming_the_field(client: TestClient, backend: InProcessBackend, field: str,
                                                   value: Any, message: str) -> None:
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


def test_out_of_range_id_is_400_and_never_reaches_the_model(client: TestClient,
                                                              backend: InProcessBackend) -> None:
    request = body()
    request["inputs"][1]["data"][26 * 2 + 5] = 10**6
    response = client.post("/models/ctr/infer", json=request)
    assert response.status_code == 400
    assert "id 1000000 in row 2 is out of range for table 5" in response.json()["error"]
    assert backend.calls == []
    assert client.post("/models/ctr/infer", json=body()).status_code == 200  # the server keeps serving


def test_non_finite_dense_value_is_400(client: TestClient) -> None:
    request = body()
    request["inputs"][0]["data"][0] = float("nan")
    response = post_raw(client, "/models/ctr/infer", json.dumps(request))  # Python's json writes NaN
    assert response.status_code == 400
    assert response.json()["error"].startswith("inputs[0].data: dense_features value nan")


def test_too_many_rows_is_400(client: TestClient) -> None:
    response = client.post("/models/ctr/infer", json=body(rows=MAX_ROWS + 1))
    assert response.status_code == 400
    assert f"exceed the limit of {MAX_ROWS} rows" in response.json()["error"]


def test_oversized_body_is_413(client: TestClient, backend: InProcessBackend) -> None:
    request = body() | {"parameters": {"padding": "x" * MAX_BODY_BYTES}}
    response = client.post("/models/ctr/infer", json=request)
    assert response.status_code == 413
    assert response.json() == {"error": f"request body exceeds {MAX_BODY_BYTES} bytes"}
    assert backend.calls == []


def test_backend_failure_is_500_without_internal_details(model: DLRM) -> None:
    client = TestClient(create_oip_api(FailingBackend(model), app_config()), raise_server_exceptions=False)
    response = client.post("/models/ctr/infer", json=body())
    assert response.status_code == 500
    assert response.json() == {"error": "internal server error"}


def test_openapi_documents_the_infer_request_schema(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    request_body = schema["paths"]["/models/{model_name}/infer"]["post"]["requestBody"]
    assert request_body["content"]["application/json"]["schema"]["$ref"].endswith("/InferRequest")
    infer_request = schema["components"]["schemas"]["InferRequest"]
    assert infer_request["required"] == ["inputs"]
    assert "FP32" in json.dumps(schema["components"]["schemas"]["InferTensor"])
