"""OIP v2 over gRPC: ``ModelInferRequest`` messages to the requests ``disagg.api.codec`` checks, and the backend's
outputs to ``ModelInferResponse`` messages.

A message becomes an ``InferRequest`` whose tensors carry no ``data`` (validated as a JSON body is, so both protocols
refuse the same fields with the same messages) and one array per input: its ``raw_input_contents`` entry (raw
little-endian bytes, as the REST binary extension's blocks) or its typed ``contents`` field. Outputs always go
back as ``raw_output_contents``, as Triton answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from disagg.api._proto import grpc_predict_v2_pb2 as pb
from disagg.api.codec import WIRE_DTYPES, invalid_field, select_outputs
from disagg.api.protocol import InferRequest, InferTensor, RequestedOutput
from disagg.id_ranges import torch_dtype
from disagg.signature import ModelSignature
from serving.common.http import validation_error_to_api_error

#: The typed ``contents`` field holding each datatype's elements and the array type read from it (FP16 has none:
#: raw contents only).
CONTENTS_FIELDS: dict[str, tuple[str, Any]] = {
    "BOOL": ("bool_contents", np.bool_), "INT8": ("int_contents", np.int32), "INT16": ("int_contents", np.int32),
    "INT32": ("int_contents", np.int32), "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint32), "UINT16": ("uint_contents", np.uint32),
    "UINT32": ("uint_contents", np.uint32), "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32), "FP64": ("fp64_contents", np.float64), "BYTES": ("bytes_contents", object),
}  # fmt: skip


def parameter_value(parameter: pb.InferParameter) -> bool | int | str | float | None:
    """The value a parameter holds, whichever of its fields is set (None: none is)."""
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def _parameters(parameters: Mapping[str, pb.InferParameter]) -> dict[str, Any] | None:
    return {key: parameter_value(value) for key, value in parameters.items()} or None


def _request_body(message: pb.ModelInferRequest) -> dict[str, Any]:
    """The message as the JSON body it stands for, tensors without ``data``."""
    body: dict[str, Any] = {
        "inputs": [{"name": tensor.name, "shape": list(tensor.shape), "datatype": tensor.datatype,
                    "parameters": _parameters(tensor.parameters)} for tensor in message.inputs],
    }
    if message.id:
        body["id"] = message.id
    if message.parameters:
        body["parameters"] = _parameters(message.parameters)
    if message.outputs:
        body["outputs"] = [{"name": output.name, "parameters": _parameters(output.parameters)}
                           for output in message.outputs]
    return body


def _raw_array(tensor: InferTensor, index: int, raw: bytes) -> np.ndarray:
    if tensor.datatype not in WIRE_DTYPES:
        raise invalid_field(f"inputs[{index}].datatype", f"{tensor.datatype} tensors are not accepted as raw contents")
    count = math.prod(tensor.shape)
    expected = count * WIRE_DTYPES[tensor.datatype].itemsize
    if len(raw) != expected:
        raise invalid_field(f"raw_input_contents[{index}]",
                            f"{len(raw)} bytes, but shape {tensor.shape} of {tensor.datatype} needs {expected}")
    return np.frombuffer(raw, WIRE_DTYPES[tensor.datatype], count=count).reshape(tensor.shape)


def _typed_array(tensor: InferTensor, index: int, contents: pb.InferTensorContents) -> np.ndarray:
    if tensor.datatype not in CONTENTS_FIELDS:
        raise invalid_field(f"inputs[{index}].contents",
                            f"{tensor.datatype} has no typed contents; send it in raw_input_contents")
    field, dtype = CONTENTS_FIELDS[tensor.datatype]
    values = getattr(contents, field)
    count = math.prod(tensor.shape)
    if len(values) != count:
        raise invalid_field(f"inputs[{index}].contents.{field}",
                            f"shape {tensor.shape} needs {count} values, got {len(values)}")
    return np.asarray(values, dtype=dtype).reshape(tensor.shape)


def parse_grpc_infer_request(message: pb.ModelInferRequest) -> tuple[InferRequest, tuple[np.ndarray, ...]]:
    """The request a ``ModelInferRequest`` stands for and each input's elements (an array of its shape), for
    ``decode_infer_inputs``; APIError(400) naming the field at fault."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise invalid_field("raw_input_contents", f"{len(raw)} entries for {len(message.inputs)} inputs: give one per "
                            "input, in order, or none (typed contents)")
    try:
        request = InferRequest.model_validate(_request_body(message))
    except ValidationError as error:
        raise validation_error_to_api_error(error.errors()) from None
    arrays = tuple(_raw_array(tensor, index, raw[index]) if raw else
                   _typed_array(tensor, index, message.inputs[index].contents)
                   for index, tensor in enumerate(request.inputs))
    return request, arrays


def grpc_infer_response(
    outputs: Sequence[torch.Tensor],
    signature: ModelSignature,
    *,
    requested: Sequence[RequestedOutput] | None,
    model_name: str,
    model_version: str,
    request_id: str | None,
) -> pb.ModelInferResponse:
    """``ModelInferResponse`` carrying the ``select_outputs`` of ``outputs``, each of its signature's datatype, as
    raw contents."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=model_version, id=request_id or "")
    for expected, output in select_outputs(outputs, signature, requested):
        values = output.detach().to("cpu", torch_dtype(expected.datatype)).contiguous()
        response.outputs.add(name=expected.name, datatype=expected.datatype, shape=list(values.shape))
        response.raw_output_contents.append(values.numpy().astype(WIRE_DTYPES[expected.datatype], copy=False).tobytes())
    return response
