"""KServe Open Inference Protocol (OIP) v2 wire schema of the recommendation app: bodies, binary-extension headers.

Spec: https://kserve.github.io/website/latest/modelserving/data_plane/v2_protocol/ . The models know nothing of
tensors or of the served model (its tensors are its ``disagg.signature.ModelSignature``); ``disagg.api.codec``
converts between them and the engine's tensors.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from disagg.signature import Datatype

#: Binary tensor data extension: the header giving the JSON's length, and the body's media type when bytes follow.
HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_MEDIA_TYPE = "application/octet-stream"
#: Tensor parameter: bytes of this tensor in the binary part of the body.
BINARY_DATA_SIZE = "binary_data_size"
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
