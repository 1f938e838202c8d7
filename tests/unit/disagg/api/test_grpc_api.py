"""OIP v2 over gRPC without Ray: the DLRM ingress's gRPC calls (``OIPGrpcIngress``, as Serve's proxy invokes them)
behind a real ``grpc.aio`` server over fake backends, called by ``tritonclient.grpc`` and by a stub of our proto;
every answer checked against the REST API's for the same request."""

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
from fastapi.testclient import TestClient
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException

from disagg.api._proto import grpc_predict_v2_pb2 as pb
from disagg.api._proto import grpc_predict_v2_pb2_grpc as pb_grpc
from disagg.api.backend import DLRMBackend
from disagg.api.codec import encode_infer_request
from disagg.api.grpc_service import GRPC_STATUS, OIPGrpcHandlers
from disagg.api.server import create_oip_api
from disagg.config import DLRMAppConfig
from disagg.deployments.grpc_ingress import OIPGrpcIngress
from tests.helpers.oip_fakes import (
    MAX_BODY_BYTES,
    MAX_ROWS,
    FailingBackend,
    FakeBackend,
    UserModelBackend,
    app_config,
    expected_scores,
    expected_user_outputs,
)

API_KEY = "grpc-key-51c0"
#: The typed contents field of each datatype these tests send (the protocol's mapping, written out here).
CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT32": "int_contents", "INT64": "int64_contents"}


class Servicer(OIPGrpcIngress, pb_grpc.GRPCInferenceServiceServicer):
    """The ingress's gRPC calls over ``backend``, as a plain gRPC servicer (Serve passes its context the same way)."""

    def __init__(self, backend: DLRMBackend, config: DLRMAppConfig, api_key: str = "") -> None:
        self.config = config
        self._oip_grpc = OIPGrpcHandlers(backend, config, api_key=api_key)


class GrpcServer:
    """A ``grpc.aio`` server on a free loopback port, its event loop in a thread of its own."""

    def __init__(self, servicer: Servicer) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self._run(self._start(servicer))

    def _run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=60)

    async def _start(self, servicer: Servicer) -> int:
        self._server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def stop(self) -> None:
        self._run(self._server.stop(None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self._loop.close()


class Served:
    """A backend answering over gRPC (``stub``, ``triton``) and over REST (``rest``), one app config for both."""

    def __init__(self, backend: DLRMBackend, api_key: str = "") -> None:
        self.backend, config = backend, app_config()
        self.server = GrpcServer(Servicer(backend, config, api_key))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.triton = triton_grpc.InferenceServerClient(f"127.0.0.1:{self.server.port}")
        self.rest = TestClient(create_oip_api(backend, config, api_key=api_key), raise_server_exceptions=False)

    def close(self) -> None:
        self.triton.close()
        self.channel.close()
        self.server.stop()


@pytest.fixture
def served() -> Iterator[Served]:
    served = Served(FakeBackend())
    yield served
    served.close()


def _rows(rows: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 13, generator=generator).numpy(),
            torch.randint(0, 3, (rows, 26), generator=generator).numpy())


def _json_body(inputs: dict[str, np.ndarray], **extra) -> dict[str, Any]:
    request = encode_infer_request({name: torch.from_numpy(array) for name, array in inputs.items()})
    return request.model_dump(exclude_none=True) | extra


def _typed(body: dict[str, Any], model: str = "ctr") -> pb.ModelInferRequest:
    """The JSON body ``body`` as a ``ModelInferRequest`` with typed contents."""
    message = pb.ModelInferRequest(model_name=model, id=body.get("id", ""))
    for tensor in body["inputs"]:
        added = message.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        getattr(added.contents, CONTENTS[tensor["datatype"]]).extend(tensor["data"])
    for output in body.get("outputs", []):
        message.outputs.add(name=output["name"])
    return message


def _refusal(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args, **kwargs)
    return refused.value


def test_our_messages_are_the_protocols_field_for_field_and_load_beside_tritonclients():
    """Same names, numbers and types as the messages ``tritonclient.grpc`` sends (both loaded in this process)."""
    ours = pb.DESCRIPTOR
    for message in ours.message_types_by_name.values():
        theirs = triton_pb.DESCRIPTOR.message_types_by_name[message.name]
        for described, reference in [(message, theirs), *zip(message.nested_types, theirs.nested_types, strict=True)]:
            fields = [(f.name, f.number, f.type, f.is_repeated) for f in described.fields]
            assert fields == [(f.name, f.number, f.type, f.is_repeated) for f in reference.fields], described.name
    triton_methods = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    for method in ours.services_by_name["GRPCInferenceService"].methods:
        assert method.input_type.full_name == triton_methods[method.name].input_type.full_name
        assert method.output_type.full_name == triton_methods[method.name].output_type.full_name


def test_health_and_metadata_answer_as_the_rest_routes(served):
    assert served.triton.is_server_live() and served.triton.is_server_ready()
    assert served.triton.is_model_ready("ctr") and served.triton.is_model_ready("ctr", "1")
    server = served.triton.get_server_metadata()
    assert {"name": server.name, "version": server.version, "extensions": list(server.extensions)} == \
        served.rest.get("/").json()
    model = served.triton.get_model_metadata("ctr", as_json=True)
    rest = served.rest.get("/models/ctr").json()
    assert model["name"] == rest["name"] and model["versions"] == rest["versions"]
    for side in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in model[side]] == \
            [(t["name"], t["datatype"], t["shape"]) for t in rest[side]]
    served.backend.is_ready = False
    assert not served.triton.is_server_ready() and not served.triton.is_model_ready("ctr")
    assert served.rest.get("/models/ctr/ready").status_code == 503


def test_tritonclient_infer_over_raw_contents_answers_the_rest_outputs(served):
    dense, sparse = _rows(rows=5, seed=1)
    inputs = [triton_grpc.InferInput("dense_features", [5, 13], "FP32"),
              triton_grpc.InferInput("sparse_features", [5, 26], "INT32")]
    inputs[0].set_data_from_numpy(dense)
    inputs[1].set_data_from_numpy(sparse.astype(np.int32))
    result = served.triton.infer("ctr", inputs, request_id="r-1")
    answered = result.get_response()
    assert (answered.model_name, answered.model_version, answered.id) == ("ctr", "1", "r-1")
    rest = served.rest.post("/models/ctr/infer", json=_json_body({"dense_features": dense, "sparse_features": sparse}))
    probabilities = result.as_numpy("probabilities")
    assert probabilities.dtype == np.float32 and probabilities.shape == (5, 1)
    assert np.array_equal(probabilities.ravel(), np.asarray(rest.json()["outputs"][0]["data"], dtype=np.float32))
    np.testing.assert_allclose(probabilities, expected_scores(dense, sparse), rtol=1e-6)
    assert torch.equal(served.backend.calls[0]["sparse"], served.backend.calls[1]["sparse"])  # INT32 widened


def test_typed_contents_and_requested_outputs_of_a_user_model():
    served = Served(UserModelBackend())
    try:
        user, history = np.array([3, 7]), np.array([[1, 2, 0], [4, 5, 6]])
        body = _json_body({"user": user, "history": history}, outputs=[{"name": "embedding"}], id="u-2")
        answered = served.stub.ModelInfer(_typed(body))
        assert [output.name for output in answered.outputs] == ["embedding"] and answered.id == "u-2"
        embedding = np.frombuffer(answered.raw_output_contents[0], dtype="<f4").reshape(list(answered.outputs[0].shape))
        rest = served.rest.post("/models/ctr/infer", json=body).json()
        assert np.array_equal(embedding.ravel(), np.asarray(rest["outputs"][0]["data"], dtype=np.float32))
        assert np.array_equal(embedding, expected_user_outputs(user, history)[1].astype(np.float32))
    finally:
        served.close()


def _out_of_range(body: dict[str, Any]) -> dict[str, Any]:
    body["inputs"][1]["data"][3] = 10**6
    return body


#: case -> what it makes of a valid JSON body (sent as it is over REST, as typed contents over gRPC)
REFUSED = {
    "unknown input": (lambda body: body | {"inputs": [body["inputs"][0] | {"name": "dense"}, body["inputs"][1]]}),
    "wrong datatype": (lambda body: body | {"inputs": [body["inputs"][0] | {"datatype": "FP64"}, body["inputs"][1]]}),
    "id out of range": _out_of_range,
    "unknown output": (lambda body: body | {"outputs": [{"name": "logits"}]}),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_infer_has_the_rest_status_and_message(served, case):
    body = REFUSED[case](_json_body(dict(zip(("dense_features", "sparse_features"), _rows(), strict=True))))
    rest = served.rest.post("/models/ctr/infer", json=body)
    refused = _refusal(served.stub.ModelInfer, _typed(body))
    assert rest.status_code == 400 and refused.code() == GRPC_STATUS[400]
    assert refused.details() == rest.json()["error"]
    assert served.backend.calls == []


def test_past_the_row_limit_and_an_unknown_model_have_the_rest_status_and_message(served):
    body = _json_body(dict(zip(("dense_features", "sparse_features"), _rows(rows=MAX_ROWS + 1), strict=True)))
    rest = served.rest.post("/models/ctr/infer", json=body)
    refused = _refusal(served.stub.ModelInfer, _typed(body))
    assert (rest.status_code, refused.code()) == (413, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert refused.details() == rest.json()["error"]
    rest = served.rest.post("/models/dlrm/infer", json=body)
    refused = _refusal(served.stub.ModelInfer, _typed(body, model="dlrm"))
    assert (rest.status_code, refused.code()) == (404, grpc.StatusCode.NOT_FOUND)
    assert refused.details() == rest.json()["error"]
    unknown = _refusal(served.stub.ModelMetadata, pb.ModelMetadataRequest(name="ctr", version="2"))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert unknown.details() == served.rest.get("/models/ctr/versions/2").json()["error"]


def _raw_request(dense: np.ndarray, sparse: np.ndarray) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="ctr")
    message.inputs.add(name="dense_features", datatype="FP32", shape=list(dense.shape))
    message.inputs.add(name="sparse_features", datatype="INT64", shape=list(sparse.shape))
    message.raw_input_contents.extend([dense.astype("<f4").tobytes(), sparse.astype("<i8").tobytes()])
    return message


def test_contents_that_do_not_fit_their_tensors_are_refused_naming_the_field(served):
    dense, sparse = _rows()
    short = _raw_request(dense, sparse)
    short.raw_input_contents[1] = short.raw_input_contents[1][:-8]
    one_entry = _raw_request(dense, sparse)
    del one_entry.raw_input_contents[1]
    typed = _typed(_json_body({"dense_features": dense, "sparse_features": sparse}))
    del typed.inputs[0].contents.fp32_contents[-1]
    half = _raw_request(dense, sparse)
    half.inputs[0].datatype = "FP16"
    half.ClearField("raw_input_contents")
    oversized = _raw_request(dense, sparse)
    oversized.id = "x" * MAX_BODY_BYTES
    expected = {
        "raw_input_contents[1]: 824 bytes, but shape [4, 26] of INT64 needs 832": short,
        "raw_input_contents: 1 entries for 2 inputs": one_entry,
        "inputs[0].contents.fp32_contents: shape [4, 13] needs 52 values, got 51": typed,
        "inputs[0].contents: FP16 has no typed contents; send it in raw_input_contents": half,
        f"request body exceeds {MAX_BODY_BYTES} bytes": oversized,
    }
    for message, request in expected.items():
        refused = _refusal(served.stub.ModelInfer, request)
        status = grpc.StatusCode.RESOURCE_EXHAUSTED if request is oversized else grpc.StatusCode.INVALID_ARGUMENT
        assert refused.code() == status and refused.details().startswith(message), refused.details()
    assert served.backend.calls == []
    answered = served.stub.ModelInfer(_raw_request(dense, sparse))  # the server lives on
    scores = np.frombuffer(answered.raw_output_contents[0], dtype="<f4")
    np.testing.assert_allclose(scores, expected_scores(dense, sparse).ravel(), rtol=1e-6)


def test_with_an_api_key_only_health_calls_are_open():
    served = Served(FakeBackend(), api_key=API_KEY)
    try:
        assert served.triton.is_server_live() and served.triton.is_server_ready()
        with pytest.raises(InferenceServerException) as missing:
            served.triton.get_model_metadata("ctr")
        assert missing.value.status() == "StatusCode.UNAUTHENTICATED"
        assert missing.value.message() == served.rest.get("/models/ctr").json()["error"]
        wrong = _refusal(served.stub.ModelInfer, _raw_request(*_rows()), metadata=[("authorization", "Bearer nope")])
        assert (wrong.code(), wrong.details()) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        assert served.backend.calls == []
        key = {"authorization": f"Bearer {API_KEY}"}
        assert served.triton.get_model_metadata("ctr", headers=key).name == "ctr"
        assert served.stub.ModelInfer(_raw_request(*_rows()), metadata=list(key.items())).outputs[0].name == \
            "probabilities"
    finally:
        served.close()


def test_an_unexpected_error_is_internal_with_the_rest_message_and_no_detail():
    served = Served(FailingBackend())
    try:
        refused = _refusal(served.stub.ModelInfer, _raw_request(*_rows()))
        rest = served.rest.post("/models/ctr/infer", json=_json_body(dict(zip(
            ("dense_features", "sparse_features"), _rows(), strict=True))))
        assert (rest.status_code, refused.code()) == (500, grpc.StatusCode.INTERNAL)
        assert refused.details() == rest.json()["error"] and "secret" not in refused.details()
        assert served.triton.is_server_live()  # the server lives on
    finally:
        served.close()
