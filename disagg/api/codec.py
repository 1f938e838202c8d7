"""The OIP v2 JSON and binary codecs together: infer bodies to validated DLRM tensors, and tensors to responses.

``parse_infer_request`` splits a body (JSON, or JSON then raw tensor bytes: the binary tensor data extension,
https://github.com/triton-inference-server/server/blob/main/docs/protocol/extension_binary_data.md) and
``decode_dlrm_request`` checks it against the model; the encoders go the other way. Every refusal is an
``APIError`` naming the field at fault. ``sparse_features`` is [B, T, H] id bags or [B, T] (H = 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from pydantic import ValidationError

from disagg.api.protocol import (
    BINARY_DATA_SIZE,
    DENSE_INPUT,
    EMPTY_SLOT,
    HEADER_LENGTH,
    PROBABILITIES_OUTPUT,
    SPARSE_DATATYPES,
    SPARSE_INPUT,
    InferRequest,
    InferResponse,
    InferTensor,
    ModelMetadata,
    TensorMetadata,
)
from disagg.config import DLRMLimits
from disagg.spec import DLRMSpec
from serving.common.errors import APIError
from serving.common.http import validation_error_to_api_error

#: Wire (little-endian) element type of each fixed-size datatype; BYTES has no fixed size.
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "i1",
        "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
    }.items()
}  # fmt: skip


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _too_large(param: str, message: str) -> APIError:
    return APIError(413, f"{param}: {message}", param=param, code="too_large")


# Bodies: JSON, or the binary tensor data extension.


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


# Wire tensors <-> the DLRM's tensors.


class DLRMInputs(NamedTuple):
    """Engine inputs: ``dense`` float32 [B, num_dense], ``sparse`` int64 ids [B, num_tables, H] (-1: empty slot)."""

    dense: torch.Tensor
    sparse: torch.Tensor


def dlrm_model_metadata(name: str, version: str, spec: DLRMSpec) -> ModelMetadata:
    """OIP metadata of a DLRM served under ``name``: its input and output tensors (canonical sparse [-1, T, -1])."""
    return ModelMetadata(
        name=name,
        versions=[version],
        platform="pytorch",
        inputs=[
            TensorMetadata(name=DENSE_INPUT, datatype="FP32", shape=[-1, spec.num_dense]),
            TensorMetadata(name=SPARSE_INPUT, datatype="INT64", shape=[-1, spec.num_tables, -1]),
        ],
        outputs=[TensorMetadata(name=PROBABILITIES_OUTPUT, datatype="FP32", shape=[-1, 1])],
    )


def _check_requested_outputs(request: InferRequest) -> None:
    for index, output in enumerate(request.outputs or []):
        if output.name != PROBABILITIES_OUTPUT:
            raise _bad(
                f"outputs[{index}].name", f"unknown output {output.name!r}; this model has {PROBABILITIES_OUTPUT!r}"
            )


def _find_inputs(request: InferRequest) -> dict[str, int]:
    """Position of each expected input in ``request.inputs``; refuses unknown, duplicate and missing ones."""
    expected = (DENSE_INPUT, SPARSE_INPUT)
    positions: dict[str, int] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name not in expected:
            raise _bad(
                f"inputs[{index}].name", f"unknown input {tensor.name!r}; expected {DENSE_INPUT!r} and {SPARSE_INPUT!r}"
            )
        if tensor.name in positions:
            raise _bad(f"inputs[{index}].name", f"duplicate input {tensor.name!r}")
        positions[tensor.name] = index
    for name in expected:
        if name not in positions:
            raise _bad("inputs", f"missing input {name!r}")
    return positions


def _check_rows(tensor: InferTensor, param: str, max_rows: int) -> int:
    rows = tensor.shape[0]
    if rows == 0:
        raise _bad(param, f"{tensor.name} has no rows")
    if rows > max_rows:
        raise _too_large(param, f"{rows} rows exceed the limit of {max_rows} rows per request")
    return rows


def _check_dense_shape(tensor: InferTensor, index: int, spec: DLRMSpec, limits: DLRMLimits) -> int:
    """Validates ``shape`` == [B, num_dense]; returns B."""
    param, features = f"inputs[{index}].shape", spec.num_dense
    if len(tensor.shape) != 2:
        raise _bad(param, f"{DENSE_INPUT} must have shape [batch, {features}], got {tensor.shape}")
    if tensor.shape[1] != features:
        raise _bad(param, f"{DENSE_INPUT} needs {features} dense features per row, got {tensor.shape[1]}")
    return _check_rows(tensor, param, limits.max_rows_per_request)


def _check_sparse_shape(tensor: InferTensor, index: int, spec: DLRMSpec, limits: DLRMLimits) -> int:
    """Validates ``shape`` == [B, num_tables] or [B, num_tables, H] with 1 <= H <= the limit; returns B."""
    param, tables = f"inputs[{index}].shape", spec.num_tables
    if len(tensor.shape) not in (2, 3):
        raise _bad(
            param,
            f"{SPARSE_INPUT} must have shape [batch, {tables}] or [batch, {tables}, ids_per_table], got {tensor.shape}",
        )
    if tensor.shape[1] != tables:
        raise _bad(
            param, f"{SPARSE_INPUT} needs {tables} sparse features (one per table) per row, got {tensor.shape[1]}"
        )
    if len(tensor.shape) == 3:
        ids, limit = tensor.shape[2], limits.max_ids_per_feature
        if ids == 0:
            raise _bad(param, f"{SPARSE_INPUT} has no id slots per table")
        if ids > limit:
            raise _bad(param, f"{ids} ids per table exceed the limit of {limit} ids per table")
    return _check_rows(tensor, param, limits.max_rows_per_request)


def _to_array(tensor: InferTensor, index: int, binary: np.ndarray | None, *, integers: bool) -> np.ndarray:
    """The input as a numpy array of ``tensor.shape``: ``binary`` if given, else ``tensor.data`` holding
    integers (or any real numbers)."""
    if binary is not None:
        return binary
    param = f"inputs[{index}].data"
    if tensor.data is None:
        raise _bad(param, "field required")
    try:
        array = np.asarray(tensor.data)
    except (ValueError, TypeError, OverflowError):
        raise _bad(param, "must be a flat list of numbers or nested lists of equal length") from None
    expected = math.prod(tensor.shape)
    if array.size != expected:
        raise _bad(param, f"shape {tensor.shape} needs {expected} values, data has {array.size}")
    if integers and array.dtype.kind not in "iu":
        raise _bad(param, f"{tensor.name} data must be integers in the int64 range")
    if not integers and array.dtype.kind not in "iuf":
        raise _bad(param, f"{tensor.name} data must be numbers")
    if array.ndim > 1 and list(array.shape) != tensor.shape:
        raise _bad(param, f"nested data has shape {list(array.shape)} but shape is {tensor.shape}")
    return array.reshape(tensor.shape)


def _decode_dense(tensor: InferTensor, index: int, binary: np.ndarray | None) -> torch.Tensor:
    if tensor.datatype != "FP32":
        raise _bad(f"inputs[{index}].datatype", f"{DENSE_INPUT} must be FP32, got {tensor.datatype}")
    with np.errstate(over="ignore", invalid="ignore"):
        dense = _to_array(tensor, index, binary, integers=False).astype(np.float32)
    not_finite = ~np.isfinite(dense)
    if not_finite.any():
        row, feature = (int(i) for i in np.argwhere(not_finite)[0])
        raise _bad(
            f"inputs[{index}].data",
            f"{DENSE_INPUT} value {dense[row, feature]} at row {row}, feature {feature} is not "
            f"a finite FP32 number ({int(not_finite.sum())} such value(s))",
        )
    return torch.from_numpy(dense)


def _decode_sparse(
    tensor: InferTensor, index: int, binary: np.ndarray | None, table_sizes: tuple[int, ...]
) -> torch.Tensor:
    if tensor.datatype not in SPARSE_DATATYPES:
        raise _bad(
            f"inputs[{index}].datatype",
            f"{SPARSE_INPUT} must be {' or '.join(SPARSE_DATATYPES)}, got {tensor.datatype}",
        )
    ids = _to_array(tensor, index, binary, integers=True)
    ids = ids.reshape(ids.shape[0], ids.shape[1], -1)
    sizes = np.asarray(table_sizes, dtype=np.int64)[:, None]
    out_of_range = (ids < EMPTY_SLOT) | (ids >= sizes)
    if out_of_range.any():
        row, table, slot = (int(i) for i in np.argwhere(out_of_range)[0])
        raise _bad(
            f"inputs[{index}].data",
            f"id {ids[row, table, slot]} in row {row} is out of range for table {table} "
            f"(valid ids 0..{table_sizes[table] - 1}, or {EMPTY_SLOT} for an empty slot; "
            f"{int(out_of_range.sum())} id(s) out of range)",
        )
    return torch.from_numpy(ids.astype(np.int64))


def decode_dlrm_request(
    request: InferRequest, spec: DLRMSpec, limits: DLRMLimits, binary_inputs: Sequence[np.ndarray | None] | None = None
) -> DLRMInputs:
    """Validated engine tensors from an infer request; APIError(400, or 413 past the row limit) otherwise.

    ``binary_inputs[i]``, where not None, is input i's binary tensor data (an array of its shape and
    datatype) in place of its JSON ``data``; None for a JSON-only request.
    """
    _check_requested_outputs(request)
    positions = _find_inputs(request)
    dense_index, sparse_index = positions[DENSE_INPUT], positions[SPARSE_INPUT]
    dense_tensor, sparse_tensor = request.inputs[dense_index], request.inputs[sparse_index]
    dense_rows = _check_dense_shape(dense_tensor, dense_index, spec, limits)
    sparse_rows = _check_sparse_shape(sparse_tensor, sparse_index, spec, limits)
    if sparse_rows != dense_rows:
        raise _bad(
            f"inputs[{sparse_index}].shape", f"{SPARSE_INPUT} has {sparse_rows} rows but {DENSE_INPUT} has {dense_rows}"
        )
    binary = binary_inputs or [None] * len(request.inputs)
    return DLRMInputs(
        dense=_decode_dense(dense_tensor, dense_index, binary[dense_index]),
        sparse=_decode_sparse(sparse_tensor, sparse_index, binary[sparse_index], spec.table_sizes),
    )


def encode_dlrm_request(dense: torch.Tensor, sparse: torch.Tensor, *, request_id: str | None = None) -> InferRequest:
    """Client side: the JSON infer request for ``dense`` [B, num_dense] and ``sparse`` ids [B, T] or [B, T, H]."""
    return InferRequest(
        id=request_id,
        inputs=[
            InferTensor(
                name=DENSE_INPUT,
                shape=list(dense.shape),
                datatype="FP32",
                data=dense.to(torch.float32).reshape(-1).tolist(),
            ),
            InferTensor(
                name=SPARSE_INPUT,
                shape=list(sparse.shape),
                datatype="INT64",
                data=sparse.to(torch.int64).reshape(-1).tolist(),
            ),
        ],
    )


def encode_dlrm_response(
    probabilities: torch.Tensor, *, model_name: str, model_version: str | None, request_id: str | None
) -> InferResponse:
    """Infer response carrying ``probabilities`` [B, 1] as the FP32 output ``probabilities``."""
    values = probabilities.detach().to("cpu", torch.float32).reshape(-1, 1)
    return InferResponse(
        model_name=model_name,
        model_version=model_version,
        id=request_id,
        outputs=[
            InferTensor(
                name=PROBABILITIES_OUTPUT, shape=list(values.shape), datatype="FP32", data=values.reshape(-1).tolist()
            )
        ],
    )
