"""OIP v2 routes of the served model: short handlers over the backend and config in ``app.state`` (``create_oip_api``).

Paths carry no ``/v2``: Ray Serve mounts the app under the route prefix ``/v2``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response

from disagg.api.backend import DLRMBackend
from disagg.api.codec import (
    decode_infer_inputs,
    encode_infer_response,
    encode_outputs,
    model_metadata,
    parse_infer_request,
)
from disagg.api.protocol import (
    BINARY_MEDIA_TYPE,
    HEADER_LENGTH,
    ErrorResponse,
    InferResponse,
    ModelMetadata,
    ModelReady,
    ServerLive,
    ServerMetadata,
    ServerReady,
)
from disagg.config import DLRMAppConfig
from serving.common.constants import SERVER_NAME
from serving.common.errors import APIError
from serving.common.http import app_state, error_responses

#: The one version every served model has; its weights are fixed for the app's lifetime.
MODEL_VERSION = "1"


Backend = Annotated[DLRMBackend, Depends(app_state("backend"))]
Config = Annotated[DLRMAppConfig, Depends(app_state("config"))]
ModelName = Annotated[str, Path(description="Name of the served model.")]
ModelVersion = Annotated[str, Path(description="Version of the served model.")]

#: Routes behind the API key, when the app has one.
router = APIRouter()
#: The health probes, always open.
health_router = APIRouter()

_NOT_READY = {"description": "Not ready: requests would fail now (e.g. an embedding shard has no replica)."}
_MODEL_ERRORS = error_responses(ErrorResponse, 404)
_MODEL_READY_RESPONSES = {**_MODEL_ERRORS, 503: {"model": ModelReady, **_NOT_READY}}
_INFER_DESCRIPTION = f"""Runs the model on a batch of rows.

The body is JSON (an `InferRequest`), or, with the binary tensor data extension, the header
`{HEADER_LENGTH}: N` says the first N bytes are that JSON and raw little-endian tensor bytes follow, one
block per input that sets `parameters.binary_data_size` (in input order) instead of `data`. Outputs come
back as binary data when the request sets `parameters.binary_data_output` or an output's
`parameters.binary_data`; such a response is `{BINARY_MEDIA_TYPE}` with the same header.

The inputs and outputs are the served model's (`GET /v2/models/{{model_name}}`; dimension 0 is the batch, -1 any
size): each input once, all with the same number of rows. An INT64 input also takes INT32 data, and a request may
leave out an input's last dimension where it is -1 (size 1)."""
_INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": f"The outputs: JSON, or `{BINARY_MEDIA_TYPE}` when binary outputs were asked for.",
        "content": {BINARY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "headers": {
            HEADER_LENGTH: {
                "description": "Bytes of JSON before the binary outputs (binary responses).",
                "schema": {"type": "string", "pattern": "^[0-9]+$"},
            }
        },
    },
    **error_responses(ErrorResponse, 400, 404, 413, 503),
}


def require_model(config: DLRMAppConfig, model_name: str, model_version: str | None = None) -> None:
    """404 unless the path names the served model (and its version, when it names one)."""
    if model_name != config.model_name:
        raise APIError(404, f"model {model_name!r} not found; this server serves {config.model_name!r}",
                       param="model_name", code="model_not_found")
    if model_version is not None and model_version != MODEL_VERSION:
        raise APIError(404, f"model {model_name!r} has no version {model_version!r}; versions: {MODEL_VERSION!r}",
                       param="model_version", code="model_not_found")


def _readiness(backend: DLRMBackend, body: dict[str, str]) -> JSONResponse:
    ready = backend.ready()
    return JSONResponse({**body, "ready": ready}, status_code=200 if ready else 503)


async def _infer(request: Request, backend: DLRMBackend, config: DLRMAppConfig) -> Response:
    parsed = parse_infer_request(await request.body(), request.headers.get(HEADER_LENGTH))
    inputs = decode_infer_inputs(parsed.request, backend.signature, backend.id_ranges, config.limits,
                                 parsed.binary_inputs)
    outputs = await backend.infer(inputs)
    response = encode_outputs(outputs, backend.signature, requested=parsed.request.outputs,
                              model_name=config.model_name, model_version=MODEL_VERSION, request_id=parsed.request.id)
    body, header_length = encode_infer_response(response, parsed.binary_outputs)
    if header_length is None:
        return Response(body, media_type="application/json")
    return Response(body, media_type=BINARY_MEDIA_TYPE, headers={HEADER_LENGTH: str(header_length)})


@router.get("/", response_model=ServerMetadata)
async def get_server_metadata(request: Request) -> ServerMetadata:
    return ServerMetadata(name=SERVER_NAME, version=request.app.version, extensions=["binary_tensor_data"])


@health_router.get("/health/live", response_model=ServerLive)
async def live() -> ServerLive:
    return ServerLive(live=True)


@health_router.get("/health/ready", response_model=ServerReady, responses={503: {"model": ServerReady, **_NOT_READY}})
async def ready(backend: Backend) -> JSONResponse:
    return _readiness(backend, {})


@router.get("/models/{model_name}", response_model=ModelMetadata, response_model_exclude_none=True,
            responses=_MODEL_ERRORS)
async def get_model_metadata(backend: Backend, config: Config, model_name: ModelName) -> ModelMetadata:
    require_model(config, model_name)
    return model_metadata(config.model_name, MODEL_VERSION, backend.signature)


@router.get("/models/{model_name}/versions/{model_version}", response_model=ModelMetadata,
            response_model_exclude_none=True, responses=_MODEL_ERRORS)
async def get_model_version_metadata(
    backend: Backend, config: Config, model_name: ModelName, model_version: ModelVersion
) -> ModelMetadata:
    require_model(config, model_name, model_version)
    return model_metadata(config.model_name, MODEL_VERSION, backend.signature)


@router.get("/models/{model_name}/ready", response_model=ModelReady, responses=_MODEL_READY_RESPONSES)
async def model_ready(backend: Backend, config: Config, model_name: ModelName) -> JSONResponse:
    require_model(config, model_name)
    return _readiness(backend, {"name": model_name})


@router.get("/models/{model_name}/versions/{model_version}/ready", response_model=ModelReady,
            responses=_MODEL_READY_RESPONSES)
async def model_version_ready(
    backend: Backend, config: Config, model_name: ModelName, model_version: ModelVersion
) -> JSONResponse:
    require_model(config, model_name, model_version)
    return _readiness(backend, {"name": model_name})


@router.post("/models/{model_name}/infer", response_model=InferResponse, description=_INFER_DESCRIPTION,
             responses=_INFER_RESPONSES)
async def infer_latest(request: Request, backend: Backend, config: Config, model_name: ModelName) -> Response:
    require_model(config, model_name)
    return await _infer(request, backend, config)


@router.post("/models/{model_name}/versions/{model_version}/infer", response_model=InferResponse,
             description=_INFER_DESCRIPTION, responses=_INFER_RESPONSES)
async def infer_version(
    request: Request, backend: Backend, config: Config, model_name: ModelName, model_version: ModelVersion
) -> Response:
    require_model(config, model_name, model_version)
    return await _infer(request, backend, config)
