"""OIP v2 binary tensor data extension: infer bodies as a JSON header followed by raw tensor bytes.

Spec: https://github.com/triton-inference-server/server/blob/main/docs/protocol/extension_binary_data.md .
A request with the HTTP header ``Inference-Header-Content-Length: N`` carries its JSON in the first N bytes
of the body and, after it, the raw little-endian bytes of every input whose ``parameters.binary_data_size``
is set, in input order. Outputs come back the same way when asked for (``outputs[].parameters.binary_data``,
or the request parameter ``binary_data_output`` for every output). Both functions here are pure: bytes in,
bytes out, APIError(400) naming the field at fault; binary inputs are views of the body, never copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from pydantic import ValidationError

from disagg.api.protocol import InferRequest, InferResponse, InferTensor
from serving.common.http import APIError, validation_error_to_api_error

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_MEDIA_TYPE = "application/octet-stream"
BINARY_DATA_SIZE = "binary_data_size"

#: Wire (little-endian) element type of each fixed-size datatype; BYTES has no fixed size.
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "i1",
        "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
    }.items()
}  # fmt: skip


@dataclass(frozen=True)
class BinaryOutputs:
    """Which outputs a request wants as binary data: a per-output choice, else the request-wide default."""

    default: bool = False
    by_name: Mapping[str, bool] = field(default_factory=dict)

    def wants(self, name: str) -> bool:
        """Whether output ``name`` goes back as binary data."""
        return self.by_name.get(name, self.default)


class ParsedInferRequest(NamedTuple):
    """An infer body split up: ``binary_inputs[i]`` is input i as a read-only array viewing the body (of its
    ``shape`` and ``datatype``), None where the input has JSON ``data``."""

    request: InferRequest
    binary_inputs: tuple[np.ndarray | None, ...]
    binary_outputs: BinaryOutputs


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _header_length(value: str | None, body_length: int) -> int:
    if value is None:
        return body_length
    if not (value.isascii() and value.isdigit()):
        raise _bad(HEADER_LENGTH, f"must be a non-negative integer, got {value!r}")
    digits = value.lstrip("0") or "0"
    # more digits than the body length has: longer than the body, and int() refuses over 4300 digits (ValueError)
    if len(digits) > len(str(body_length)) or int(digits) > body_length:
        shown = digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"
        raise _bad(HEADER_LENGTH, f"JSON header of {shown} bytes is longer than the {body_length}-byte body")
    return int(digits)


def _binary_size(tensor: InferTensor, index: int) -> int | None:
    """Validated ``parameters.binary_data_size`` of input ``index``; None when it carries JSON ``data``."""
    size = (tensor.parameters or {}).get(BINARY_DATA_SIZE)
    param = f"inputs[{index}].parameters.{BINARY_DATA_SIZE}"
    if size is None:
        if tensor.data is None:
            raise _bad(f"inputs[{index}].data", f"field required (or parameters.{BINARY_DATA_SIZE})")
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad(param, f"must be a non-negative integer, got {size!r}")
    if tensor.data is not None:
        raise _bad(f"inputs[{index}].data", f"give either data or parameters.{BINARY_DATA_SIZE}, not both")
    if tensor.datatype not in WIRE_DTYPES:
        raise _bad(f"inputs[{index}].datatype", f"{tensor.datatype} tensors are not accepted as binary data")
    expected = math.prod(tensor.shape) * WIRE_DTYPES[tensor.datatype].itemsize
    if size != expected:
        raise _bad(param, f"{size} bytes, but shape {tensor.shape} of {tensor.datatype} needs {expected}")
    return size


def _flag(parameters: dict[str, Any] | None, key: str, param: str) -> bool | None:
    value = (parameters or {}).get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(param, f"must be true or false, got {value!r}")
    return value


def _binary_outputs(request: InferRequest) -> BinaryOutputs:
    default = _flag(request.parameters, "binary_data_output", "parameters.binary_data_output")
    by_name: dict[str, bool] = {}
    for index, output in enumerate(request.outputs or []):
        choice = _flag(output.parameters, "binary_data", f"outputs[{index}].parameters.binary_data")
        if choice is not None:
            by_name[output.name] = choice
    return BinaryOutputs(default=bool(default), by_name=by_name)


def parse_infer_request(body: bytes, header_length: str | None) -> ParsedInferRequest:
    """The request in ``body``; ``header_length`` is the ``Inference-Header-Content-Length`` header, if any."""
    length = _header_length(header_length, len(body))
    try:
        request = InferRequest.model_validate_json(body[:length])
    except ValidationError as error:
        raise validation_error_to_api_error(error.errors()) from None
    sizes = [_binary_size(tensor, index) for index, tensor in enumerate(request.inputs)]
    declared, available = sum(size or 0 for size in sizes), len(body) - length
    if declared != available:
        raise _bad(
            "body",
            f"inputs declare {declared} bytes of binary data, but {available} bytes follow "
            f"the {length}-byte JSON header",
        )
    binary_inputs: list[np.ndarray | None] = []
    offset = length
    for tensor, size in zip(request.inputs, sizes, strict=True):
        if size is None:
            binary_inputs.append(None)
            continue
        array = np.frombuffer(body, WIRE_DTYPES[tensor.datatype], count=math.prod(tensor.shape), offset=offset)
        binary_inputs.append(array.reshape(tensor.shape))
        offset += size
    return ParsedInferRequest(request, tuple(binary_inputs), _binary_outputs(request))


def encode_infer_response(response: InferResponse, binary_outputs: BinaryOutputs) -> tuple[bytes, int | None]:
    """Response body, and its JSON header's length when outputs in ``binary_outputs`` follow it as raw bytes."""
    tensors: list[InferTensor] = []
    raw: list[bytes] = []
    for output in response.outputs:
        if binary_outputs.wants(output.name):
            data = np.asarray(output.data, dtype=WIRE_DTYPES[output.datatype]).tobytes()
            raw.append(data)
            output = output.model_copy(
                update={"data": None, "parameters": (output.parameters or {}) | {BINARY_DATA_SIZE: len(data)}}
            )
        tensors.append(output)
    header = response.model_copy(update={"outputs": tensors}).model_dump_json(exclude_none=True).encode()
    if not raw:
        return header, None
    return b"".join([header, *raw]), len(header)
