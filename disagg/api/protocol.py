"""KServe Open Inference Protocol (OIP) v2 over HTTP/JSON: wire schema and DLRM tensor conversion.

Spec: https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/ . The wire models
below know nothing about the DLRM; ``decode_dlrm_request`` / ``encode_dlrm_response`` translate
between them and the engine's tensors, refusing bad input with a 400 that names the field at fault.
Inputs sent as binary tensor data (``disagg.api.binary``) arrive here as arrays beside the request.

``sparse_features`` is [B, T, H]: H ids per table (a multi-hot bag, sum-pooled), -1 marking an empty
slot; [B, T] is accepted as H = 1. Model metadata shows the canonical [-1, T, -1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from disagg.config import DLRMLimits
from disagg.model import DLRMSpec
from serving.common.http import APIError

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip

DENSE_INPUT = "dense_features"
SPARSE_INPUT = "sparse_features"
PROBABILITIES_OUTPUT = "probabilities"
SPARSE_DATATYPES: tuple[Datatype, ...] = ("INT64", "INT32")
EMPTY_SLOT = -1
#: Wire models take JSON types as the schema states them: no `true` for 1 in a shape.
_WIRE_CONFIG = ConfigDict(extra="forbid", strict=True)


class InferTensor(BaseModel):
    """A named tensor: request input or response output."""

    model_config = _WIRE_CONFIG

    name: str = Field(min_length=1, description="Tensor name.")
    shape: list[Annotated[int, Field(ge=0)]] = Field(description="Dimensions, e.g. [batch, features].")
    datatype: Datatype = Field(description="Element type.")
    parameters: dict[str, Any] | None = Field(
        None,
        description="Tensor parameters: `binary_data_size` (bytes of this tensor in the binary part of "
        "the body, instead of `data`); others are ignored.",
    )
    data: list[Any] | None = Field(
        None,
        description="Elements in row-major order, as a flat list or nested lists; required unless the "
        "tensor is binary data.",
    )


class RequestedOutput(BaseModel):
    """An output the client asks for by name."""

    model_config = _WIRE_CONFIG

    name: str = Field(description="Output name.")
    parameters: dict[str, Any] | None = Field(
        None, description="Output parameters: `binary_data` (true: return it as binary data); others are ignored."
    )


class InferRequest(BaseModel):
    """Body of ``POST /v2/models/{name}[/versions/{version}]/infer``."""

    model_config = _WIRE_CONFIG

    id: str | None = Field(None, description="Request identifier, echoed in the response.")
    parameters: dict[str, Any] | None = Field(
        None,
        description="Request parameters: `binary_data_output` (true: return every output as binary data "
        "unless the output says otherwise); others are ignored.",
    )
    inputs: list[InferTensor] = Field(min_length=1, description="Input tensors.")
    outputs: list[RequestedOutput] | None = Field(None, description="Outputs to return; all when omitted.")


class InferResponse(BaseModel):
    """Response of an infer request."""

    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[InferTensor]


class TensorMetadata(BaseModel):
    """Name, type and shape of a model input or output; -1 marks a variable dimension."""

    name: str
    datatype: Datatype
    shape: list[int]


class ModelMetadata(BaseModel):
    """Response of ``GET /v2/models/{name}``."""

    name: str
    versions: list[str] | None = None
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    """Response of ``GET /v2``."""

    name: str
    version: str
    extensions: list[str]


class ServerLive(BaseModel):
    """Response of ``GET /v2/health/live``."""

    live: bool


class ServerReady(BaseModel):
    """Response of ``GET /v2/health/ready``: 200 when ready, else 503."""

    ready: bool


class ModelReady(BaseModel):
    """Response of ``GET /v2/models/{name}[/versions/{version}]/ready``: 200 when ready, else 503."""

    name: str
    ready: bool


class ErrorResponse(BaseModel):
    """Any OIP error: ``{"error": "<message>"}``."""

    error: str


class DLRMInputs(NamedTuple):
    """Engine inputs: ``dense`` float32 [B, num_dense], ``sparse`` int64 ids [B, num_tables, H] (-1: empty slot)."""

    dense: torch.Tensor
    sparse: torch.Tensor


def dlrm_model_metadata(name: str, version: str, spec: DLRMSpec) -> ModelMetadata:
    """OIP metadata of a DLRM served under ``name``: its input and output tensors."""
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


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _too_large(param: str, message: str) -> APIError:
    return APIError(413, f"{param}: {message}", param=param, code="too_large")


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
    """Validated engine tensors from an infer request; APIError(400) naming the field otherwise.

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
