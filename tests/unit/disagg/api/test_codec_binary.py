"""OIP v2 binary tensor data codec: splitting request bodies, encoding responses, and every refusal."""

import json
from typing import Any

import numpy as np
import pytest

from disagg.api.codec import BinaryOutputs, encode_infer_response, parse_infer_request
from disagg.api.protocol import InferResponse, InferTensor
from serving.common.errors import APIError
from tests.helpers.oip_fakes import binary_body

DENSE = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
IDS = np.array([[[1, -1], [2, 3]], [[4, 5], [-1, -1]]], dtype=np.int32)


def request_dict() -> dict[str, Any]:
    return {
        "id": "r-1",
        "inputs": [
            {"name": "dense", "shape": [2, 3], "datatype": "FP32", "data": DENSE.ravel().tolist()},
            {"name": "ids", "shape": [2, 2, 2], "datatype": "INT32", "data": IDS.ravel().tolist()},
        ],
    }


def test_json_body_without_header_has_no_binary_parts() -> None:
    parsed = parse_infer_request(json.dumps(request_dict()).encode(), None)
    assert parsed.request.id == "r-1" and parsed.request.inputs[1].data == IDS.ravel().tolist()
    assert parsed.binary_inputs == (None, None)
    assert not parsed.binary_outputs.wants("anything")


def test_binary_inputs_are_typed_views_of_the_body_in_input_order() -> None:
    body, length = binary_body(request_dict(), {"dense": DENSE, "ids": IDS})
    parsed = parse_infer_request(body, length)
    dense, ids = parsed.binary_inputs
    assert dense.dtype == np.float32 and np.array_equal(dense, DENSE)
    assert ids.dtype == np.int32 and ids.shape == (2, 2, 2) and np.array_equal(ids, IDS)
    assert ids.base is not None and not ids.flags.writeable  # a view of the body, not a copy
    assert parsed.request.inputs[0].data is None


def test_binary_and_json_inputs_mix() -> None:
    body, length = binary_body(request_dict(), {"ids": IDS})
    parsed = parse_infer_request(body, length)
    assert parsed.binary_inputs[0] is None and parsed.request.inputs[0].data == DENSE.ravel().tolist()
    assert np.array_equal(parsed.binary_inputs[1], IDS)


def test_header_length_equal_to_the_body_means_no_binary_data() -> None:
    body = json.dumps(request_dict()).encode()
    assert parse_infer_request(body, str(len(body))).binary_inputs == (None, None)


def test_empty_tensor_may_be_binary() -> None:
    request = request_dict()
    request["inputs"][0]["shape"] = [0, 3]
    body, length = binary_body(request, {"dense": np.zeros((0, 3), np.float32)})
    assert parse_infer_request(body, length).binary_inputs[0].shape == (0, 3)


@pytest.mark.parametrize(
    ("parameters", "outputs", "expected"),
    [
        (None, None, {"a": False, "b": False}),
        ({"binary_data_output": True}, None, {"a": True, "b": True}),
        ({"binary_data_output": True}, [{"name": "a", "parameters": {"binary_data": False}}], {"a": False, "b": True}),
        (None, [{"name": "a", "parameters": {"binary_data": True}}, {"name": "b"}], {"a": True, "b": False}),
    ],
)
def test_binary_outputs_follow_the_output_then_the_request(parameters, outputs, expected) -> None:
    request = request_dict() | {"parameters": parameters, "outputs": outputs}
    wants = parse_infer_request(json.dumps(request).encode(), None).binary_outputs
    assert {name: wants.wants(name) for name in expected} == expected


def with_header(length: str) -> tuple[bytes, str]:
    return json.dumps(request_dict()).encode(), length


def binary_with(mutate) -> tuple[bytes, str]:
    request = request_dict()
    body, length = binary_body(request, {"dense": DENSE})
    header = json.loads(body[: int(length)])
    mutate(header)
    encoded = json.dumps(header).encode()
    return encoded + body[int(length) :], str(len(encoded))


def dense_binary(cut: int = 0, extra: bytes = b"") -> tuple[bytes, str]:
    """Dense as 24 binary bytes, less ``cut`` bytes at the end, plus ``extra``."""
    body, length = binary_body(request_dict(), {"dense": DENSE})
    return body[: len(body) - cut] + extra, length


def set_dense(key: str, value: Any):
    def mutate(header: dict) -> None:
        header["inputs"][0][key] = value

    return mutate


def set_size(value: Any):
    def mutate(header: dict) -> None:
        header["inputs"][0]["parameters"]["binary_data_size"] = value

    return mutate


SIZE = "inputs[0].parameters.binary_data_size"
ERROR_CASES = {
    "header length not a number": (lambda: with_header("12a"), "Inference-Header-Content-Length", "non-negative"),
    "negative header length": (lambda: with_header("-1"), "Inference-Header-Content-Length", "non-negative"),
    "header longer than body": (lambda: with_header("100000"), "Inference-Header-Content-Length", "longer than"),
    "header is not JSON": (lambda: (b"\x00\x01binary", "2"), "body", "not valid JSON"),
    "header cut mid-JSON": (lambda: (json.dumps(request_dict()).encode(), "20"), "body", "not valid JSON"),
    "schema violation in header": (lambda: binary_with(set_dense("datatype", "FLOAT")), "inputs[0].datatype", ""),
    "data and binary": (lambda: binary_with(set_dense("data", [0.0] * 6)), "inputs[0].data", "not both"),
    "neither data nor binary": (lambda: binary_with(set_dense("parameters", {})), "inputs[0].data", "field required"),
    "size not an integer": (lambda: binary_with(set_size("24")), SIZE, "non-negative integer"),
    "size is a bool": (lambda: binary_with(set_size(True)), SIZE, "non-negative integer"),
    "negative size": (lambda: binary_with(set_size(-24)), SIZE, "non-negative integer"),
    "size vs shape": (lambda: binary_with(set_dense("shape", [3, 3])), SIZE,
                      "24 bytes, but shape [3, 3] of FP32 needs 36"),
    "size vs datatype": (lambda: binary_with(set_dense("datatype", "FP64")), SIZE, "needs 48"),
    "huge shape": (lambda: binary_with(set_dense("shape", [10**12, 10**12])), SIZE, "needs 4000000000000000000000000"),
    "bytes tensor": (lambda: binary_with(set_dense("datatype", "BYTES")), "inputs[0].datatype", "not accepted"),
    "binary shorter than declared": (lambda: dense_binary(cut=4), "body",
                                     "declare 24 bytes of binary data, but 20 bytes follow"),
    "binary longer than declared": (lambda: dense_binary(extra=b"xx"), "body", "but 26 bytes follow"),
    "binary size without header": (lambda: (dense_binary(cut=24)[0], None), "body",
                                   "declare 24 bytes of binary data, but 0 bytes follow"),
    "binary_data_output not a bool": (lambda: binary_with(lambda h: h.update(parameters={"binary_data_output": 1})),
                                      "parameters.binary_data_output", "true or false"),
    "binary_data not a bool": (lambda: binary_with(lambda h: h.update(outputs=[{"name": "y", "parameters": {
        "binary_data": "yes"}}])), "outputs[0].parameters.binary_data", "true or false"),
}  # fmt: skip


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
def test_bad_body_is_a_400_naming_the_field(case: str) -> None:
    make, param, message = ERROR_CASES[case]
    body, length = make()
    with pytest.raises(APIError) as raised:
        parse_infer_request(body, length)
    assert raised.value.status_code == 400
    assert raised.value.param == param
    assert message in raised.value.message


def response() -> InferResponse:
    return InferResponse(
        model_name="m",
        model_version="1",
        id="r-1",
        outputs=[
            InferTensor(name="p", shape=[3, 1], datatype="FP32", data=[0.25, 0.5, 0.125]),
            InferTensor(name="n", shape=[2], datatype="INT64", data=[7, -8]),
        ],
    )


def test_json_response_has_no_header_length() -> None:
    body, length = encode_infer_response(response(), BinaryOutputs())
    assert length is None
    assert json.loads(body) == response().model_dump(exclude_none=True)


def test_binary_outputs_follow_the_json_header_in_output_order() -> None:
    body, length = encode_infer_response(response(), BinaryOutputs(default=True, by_name={"n": False}))
    header = json.loads(body[:length])
    p, n = header["outputs"]
    assert "data" not in p and p["parameters"] == {"binary_data_size": 12}
    assert n["data"] == [7, -8] and "parameters" not in n
    assert np.array_equal(np.frombuffer(body[length:], "<f4"), [0.25, 0.5, 0.125])
    assert header["id"] == "r-1" and len(body) == length + 12
