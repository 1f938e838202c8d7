"""The OIP v2 JSON and binary codecs together: infer bodies to validated model tensors, and tensors to responses.

``parse_infer_request`` splits a body (JSON, or JSON then raw tensor bytes: the binary tensor data extension,
https://github.com/triton-inference-server/server/blob/main/docs/protocol/extension_binary_data.md) and
``decode_infer_inputs`` checks it against the served model's signature and id ranges; the encoders go the other
way. Every refusal is an ``APIError`` naming the field at fault. A request may leave out an input's trailing
variable dimension (size 1): the DLRM's ``sparse_features`` is [B, T, H] id bags or [B, T].
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
    HEADER_LENGTH,
    InferRequest,
    InferResponse,
    InferTensor,
    ModelMetadata,
    RequestedOutput,
    TensorMetadata,
)
from disagg.config import DLRMLimits
from disagg.id_ranges import IdRange, torch_dtype
from disagg.signature import (
    EMPTY_SLOT,
    FLOAT_DATATYPES,
    INTEGER_DATATYPES,
    VARIABLE,
    Datatype,
    InputSignature,
    ModelSignature,
    OutputSignature,
)
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


def invalid_field(param: str, message: str) -> APIError:
    """A 400 naming the request field ``param`` at fault."""
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def too_large(param: str, message: str) -> APIError:
    """A 413: the request field ``param`` is past a limit."""
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
        raise invalid_field(HEADER_LENGTH, f"must be a non-negative integer, got {value!r}")
    digits = value.lstrip("0") or "0"
    # more digits than the body length has: longer than the body, and int() refuses over 4300 digits (ValueError)
    if len(digits) > len(str(body_length)) or int(digits) > body_length:
        shown = digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"
        raise invalid_field(HEADER_LENGTH, f"JSON header of {shown} bytes is longer than the {body_length}-byte body")
    return int(digits)


def _binary_size(tensor: InferTensor, index: int) -> int | None:
    """Validated ``parameters.binary_data_size`` of input ``index``; None when it carries JSON ``data``."""
    size = (tensor.parameters or {}).get(BINARY_DATA_SIZE)
    param = f"inputs[{index}].parameters.{BINARY_DATA_SIZE}"
    if size is None:
        if tensor.data is None:
            raise invalid_field(f"inputs[{index}].data", f"field required (or parameters.{BINARY_DATA_SIZE})")
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise invalid_field(param, f"must be a non-negative integer, got {size!r}")
    if tensor.data is not None:
        raise invalid_field(f"inputs[{index}].data", f"give either data or parameters.{BINARY_DATA_SIZE}, not both")
    if tensor.datatype not in WIRE_DTYPES:
        raise invalid_field(f"inputs[{index}].datatype", f"{tensor.datatype} tensors are not accepted as binary data")
    expected = math.prod(tensor.shape) * WIRE_DTYPES[tensor.datatype].itemsize
    if size != expected:
        raise invalid_field(param, f"{size} bytes, but shape {tensor.shape} of {tensor.datatype} needs {expected}")
    return size


def _flag(parameters: dict[str, Any] | None, key: str, param: str) -> bool | None:
    value = (parameters or {}).get(key)
    if value is not None and not isinstance(value, bool):
        raise invalid_field(param, f"must be true or false, got {value!r}")
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
        raise invalid_field(
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


# Wire tensors <-> the served model's tensors.

#: The datatype a client's tensor is sent as, by its element type.
_DATATYPES: dict[torch.dtype, Datatype] = {
    torch.bool: "BOOL", torch.uint8: "UINT8", torch.int8: "INT8", torch.int16: "INT16", torch.int32: "INT32",
    torch.int64: "INT64", torch.float16: "FP16", torch.float32: "FP32", torch.float64: "FP64",
}  # fmt: skip
#: The numpy element type each input datatype is decoded to.
_NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {"BOOL": "?", "INT32": "i4", "INT64": "i8", "FP16": "f2", "FP32": "f4", "FP64": "f8"}.items()
}


def model_metadata(name: str, version: str, signature: ModelSignature) -> ModelMetadata:
    """OIP metadata of the model served under ``name``: its signature's inputs and outputs (-1: variable size)."""
    return ModelMetadata(
        name=name,
        versions=[version],
        platform="pytorch",
        inputs=[TensorMetadata(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in signature.inputs],
        outputs=[TensorMetadata(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in signature.outputs],
    )


def _listed(names: Sequence[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _shape_text(shape: Sequence[int]) -> str:
    """The shapes a request may give an input of signature ``shape``."""
    if len(shape) > 1 and shape[-1] == VARIABLE:
        return f"{list(shape)} or {list(shape[:-1])} (-1: any size)"
    return f"{list(shape)} (-1: any size)" if VARIABLE in shape[1:] else f"{list(shape)} (-1: any number of rows)"


def _at(position: Sequence[int]) -> str:
    """Where ``position`` (row first) is in a tensor, as a message says it."""
    row, rest = int(position[0]), [int(i) for i in position[1:]]
    if not rest:
        return f"row {row}"
    return f"row {row}, position {rest[0] if len(rest) == 1 else rest}"


def _check_requested_outputs(request: InferRequest, signature: ModelSignature) -> None:
    names = [tensor.name for tensor in signature.outputs]
    requested: set[str] = set()
    for index, output in enumerate(request.outputs or []):
        if output.name not in names:
            raise invalid_field(f"outputs[{index}].name",
                                f"unknown output {output.name!r}; this model has {_listed(names)}")
        if output.name in requested:
            raise invalid_field(f"outputs[{index}].name", f"duplicate output {output.name!r}")
        requested.add(output.name)


def _find_inputs(request: InferRequest, signature: ModelSignature) -> list[tuple[int, InputSignature]]:
    """Each request input's position and signature, in request order; refuses unknown, duplicate and missing ones."""
    expected = {tensor.name: tensor for tensor in signature.inputs}
    found: dict[str, int] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name not in expected:
            raise invalid_field(f"inputs[{index}].name",
                                f"unknown input {tensor.name!r}; expected {_listed(list(expected))}")
        if tensor.name in found:
            raise invalid_field(f"inputs[{index}].name", f"duplicate input {tensor.name!r}")
        found[tensor.name] = index
    for name in expected:
        if name not in found:
            raise invalid_field("inputs", f"missing input {name!r}; expected {_listed(list(expected))}")
    return [(index, expected[name]) for name, index in found.items()]


def _check_datatype(tensor: InferTensor, index: int, expected: InputSignature) -> None:
    """An INT64 input also takes INT32 data; other inputs take their own datatype only."""
    accepted = ("INT64", "INT32") if expected.datatype == "INT64" else (expected.datatype,)
    if tensor.datatype not in accepted:
        raise invalid_field(f"inputs[{index}].datatype",
                            f"{tensor.name} must be {' or '.join(accepted)}, got {tensor.datatype}")


def _checked_shape(tensor: InferTensor, index: int, expected: InputSignature, limits: DLRMLimits) -> list[int]:
    """``tensor.shape`` as ``expected.shape`` has it (a left-out trailing variable dimension is 1), checked against
    its fixed sizes and the limits: 1 to ``max_rows_per_request`` rows (413 past it), 1 to ``max_ids_per_feature``
    along each other variable dimension."""
    param, wanted = f"inputs[{index}].shape", expected.shape
    omits_last = len(wanted) > 1 and wanted[-1] == VARIABLE and len(tensor.shape) == len(wanted) - 1
    shape = [*tensor.shape, 1] if omits_last else tensor.shape
    if len(shape) != len(wanted):
        raise invalid_field(param, f"{tensor.name} must have shape {_shape_text(wanted)}, got {tensor.shape}")
    for axis in range(1, len(wanted)):
        size, limit = shape[axis], limits.max_ids_per_feature
        if wanted[axis] != VARIABLE and size != wanted[axis]:
            raise invalid_field(param, f"{tensor.name} needs {wanted[axis]} values along dimension {axis}, got {size}")
        if size == 0:
            raise invalid_field(param, f"{tensor.name} has no values along dimension {axis}")
        if wanted[axis] == VARIABLE and size > limit:
            raise invalid_field(param, f"{tensor.name} has {size} values along dimension {axis}, over the limit of "
                                f"{limit} per variable dimension")
    rows, max_rows = shape[0], limits.max_rows_per_request
    if rows == 0:
        raise invalid_field(param, f"{tensor.name} has no rows")
    if rows > max_rows:
        raise too_large(param, f"{rows} rows exceed the limit of {max_rows} rows per request")
    return shape


def _json_array(tensor: InferTensor, index: int) -> np.ndarray:
    """``tensor.data`` as a numpy array of ``tensor.shape``'s count of values, flat or of that shape (any element
    type: the caller checks it)."""
    param = f"inputs[{index}].data"
    if tensor.data is None:
        raise invalid_field(param, "field required")
    try:
        array = np.asarray(tensor.data)
    except (ValueError, TypeError, OverflowError):
        raise invalid_field(param, "must be a flat list of numbers or nested lists of equal length") from None
    expected = math.prod(tensor.shape)
    if array.size != expected:
        raise invalid_field(param, f"shape {tensor.shape} needs {expected} values, data has {array.size}")
    if array.ndim > 1 and list(array.shape) != tensor.shape:
        raise invalid_field(param, f"nested data has shape {list(array.shape)} but shape is {tensor.shape}")
    return array


def _floats(array: np.ndarray, tensor: InferTensor, index: int, datatype: str) -> np.ndarray:
    """Finite numbers of ``datatype`` (JSON integers included)."""
    if array.dtype.kind not in "iuf":
        raise invalid_field(f"inputs[{index}].data", f"{tensor.name} data must be numbers")
    with np.errstate(over="ignore", invalid="ignore"):
        values = array.astype(_NUMPY_DTYPES[datatype])
    not_finite = ~np.isfinite(values)
    if not_finite.any():
        position = np.unravel_index(int(np.argmax(not_finite)), values.shape)
        raise invalid_field(
            f"inputs[{index}].data",
            f"{tensor.name} value {values[position]} at {_at(position)} is not a finite {datatype} number "
            f"({int(not_finite.sum())} such value(s))",
        )
    return values


def _integers(array: np.ndarray, tensor: InferTensor, index: int, datatype: str) -> np.ndarray:
    """Integers within the range of the request's datatype (JSON ones may be any size), widened to ``datatype``."""
    wire = WIRE_DTYPES[tensor.datatype]
    if array.dtype.kind not in "iu" or (
        array.dtype != wire and not np.iinfo(wire).min <= array.min() <= array.max() <= np.iinfo(wire).max
    ):
        raise invalid_field(f"inputs[{index}].data",
                            f"{tensor.name} data must be integers in the {tensor.datatype} range")
    return array.astype(_NUMPY_DTYPES[datatype])


def _booleans(array: np.ndarray, tensor: InferTensor, index: int) -> np.ndarray:
    """true/false or 0/1 (binary BOOL data: bytes 0 and 1)."""
    numbers = array.view(np.uint8) if array.dtype.kind == "b" else array
    if numbers.dtype.kind not in "iu" or ((numbers != 0) & (numbers != 1)).any():
        raise invalid_field(f"inputs[{index}].data", f"{tensor.name} data must be true/false or 0/1")
    return array.astype(np.bool_)


def _check_ids(ids: np.ndarray, valid: IdRange, tensor: InferTensor, index: int) -> None:
    """Every id within ``valid`` for its position; else a 400 naming the first one's position and table."""
    out_of_range = (ids < valid.low) | (ids >= valid.high)
    if not out_of_range.any():
        return
    position = np.unravel_index(int(np.argmax(out_of_range)), ids.shape)
    high, table = np.broadcast_to(valid.high, ids.shape)[position], np.broadcast_to(valid.tables, ids.shape)[position]
    empty_slot = f", or {EMPTY_SLOT} for an empty slot" if valid.low == EMPTY_SLOT else ""
    where = "" if table is None else f" for table {table}"
    ids_range = "0 or more" if table is None else f"0..{high - 1}"
    raise invalid_field(
        f"inputs[{index}].data",
        f"id {ids[position]} in {_at(position[: len(tensor.shape)])} is out of range{where} (valid ids {ids_range}"
        f"{empty_slot}; {int(out_of_range.sum())} id(s) out of range)",
    )


def _decode_input(
    tensor: InferTensor, index: int, binary: np.ndarray | None, expected: InputSignature, shape: list[int],
    valid: IdRange | None,
) -> torch.Tensor:
    """One checked input (``binary``, else its JSON ``data``) of ``shape`` and the signature's element type."""
    array = (_json_array(tensor, index) if binary is None else binary).reshape(tensor.shape)
    if expected.datatype in FLOAT_DATATYPES:
        values = _floats(array, tensor, index, expected.datatype)
    elif expected.datatype in INTEGER_DATATYPES:
        values = _integers(array, tensor, index, expected.datatype)
    else:
        values = _booleans(array, tensor, index)
    values = values.reshape(shape)
    if valid is not None:
        _check_ids(values, valid, tensor, index)
    return torch.from_numpy(values)


def decode_infer_inputs(
    request: InferRequest,
    signature: ModelSignature,
    id_ranges: Mapping[str, IdRange],
    limits: DLRMLimits,
    binary_inputs: Sequence[np.ndarray | None] | None = None,
) -> dict[str, torch.Tensor]:
    """The model's inputs, keyed by ``forward`` argument (signature order), each of its signature's element type and
    rank; APIError(400, or 413 past the row limit) naming the field at fault otherwise.

    Every input of ``signature`` once, with its datatype (an INT64 input also takes INT32), fixed sizes and one
    batch size; ids within ``id_ranges`` (by wire name); requested outputs of the signature. ``binary_inputs[i]``,
    where not None, is input i's binary tensor data (an array of its shape and datatype) in place of its JSON
    ``data``; None for a JSON-only request.
    """
    _check_requested_outputs(request, signature)
    found = _find_inputs(request, signature)
    shapes: dict[int, list[int]] = {}
    for index, expected in found:
        _check_datatype(request.inputs[index], index, expected)
        shapes[index] = _checked_shape(request.inputs[index], index, expected, limits)
    (first, _), *others = found
    for index, _ in others:
        if shapes[index][0] != shapes[first][0]:
            raise invalid_field(f"inputs[{index}].shape", f"{request.inputs[index].name} has {shapes[index][0]} rows "
                                f"but {request.inputs[first].name} has {shapes[first][0]}")
    binary = binary_inputs or [None] * len(request.inputs)
    positions = {expected.name: index for index, expected in found}
    inputs = {}
    for expected in signature.inputs:
        index = positions[expected.name]
        inputs[expected.forward_argument] = _decode_input(request.inputs[index], index, binary[index], expected,
                                                          shapes[index], id_ranges.get(expected.name))
    return inputs


def encode_infer_request(inputs: Mapping[str, torch.Tensor], *, request_id: str | None = None) -> InferRequest:
    """Client side: the JSON infer request for ``inputs`` keyed by wire name, each sent as the datatype of its
    element type (ValueError for one OIP has none for, e.g. bfloat16)."""
    tensors = []
    for name, tensor in inputs.items():
        if tensor.dtype not in _DATATYPES:
            raise ValueError(f"input {name!r}: no OIP datatype for {tensor.dtype}")
        tensors.append(InferTensor(name=name, shape=list(tensor.shape), datatype=_DATATYPES[tensor.dtype],
                                   data=tensor.detach().cpu().reshape(-1).tolist()))
    return InferRequest(id=request_id, inputs=tensors)


def _output_tensor(expected: OutputSignature, output: torch.Tensor) -> InferTensor:
    values = output.detach().to("cpu", torch_dtype(expected.datatype))
    return InferTensor(name=expected.name, shape=list(values.shape), datatype=expected.datatype,
                       data=values.reshape(-1).tolist())


def select_outputs(
    outputs: Sequence[torch.Tensor], signature: ModelSignature, requested: Sequence[RequestedOutput] | None
) -> list[tuple[OutputSignature, torch.Tensor]]:
    """``outputs`` (the backend's, in signature order) with their signatures: those ``requested`` (the request's
    ``outputs``, checked, in its order), or all when it names none."""
    produced = {expected.name: (expected, output) for expected, output in zip(signature.outputs, outputs, strict=True)}
    names = [output.name for output in requested] if requested else list(produced)
    return [produced[name] for name in names]


def encode_outputs(
    outputs: Sequence[torch.Tensor],
    signature: ModelSignature,
    *,
    requested: Sequence[RequestedOutput] | None,
    model_name: str,
    model_version: str | None,
    request_id: str | None,
) -> InferResponse:
    """Infer response carrying the ``select_outputs`` of ``outputs``, each of its signature's datatype."""
    return InferResponse(
        model_name=model_name,
        model_version=model_version,
        id=request_id,
        outputs=[_output_tensor(*selected) for selected in select_outputs(outputs, signature, requested)],
    )
