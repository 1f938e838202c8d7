"""OIP v2 HTTP API for one DLRM, independent of how and where the model runs.

Routes carry no ``/v2`` prefix: Ray Serve mounts the app under the route prefix ``/v2``. Infer bodies are
JSON or use the binary tensor data extension (``disagg.api.binary``), so infer routes parse the raw body.

API-key auth (``serving.common.auth``): with ``api_key`` set, every route but the probes ``GET /v2/health/live``
and ``GET /v2/health/ready`` (and the docs) needs ``Authorization: Bearer <key>``: infer, model metadata,
per-model readiness and server metadata (``GET /v2``), as Triton's ``--http-restricted-api`` with all but
``health`` restricted; otherwise 401 ``{"error": "..."}`` with ``WWW-Authenticate: Bearer``.
"""

from __future__ import annotations

from importlib import metadata as package_metadata
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema

from disagg.api.binary import BINARY_MEDIA_TYPE, HEADER_LENGTH, encode_infer_response, parse_infer_request
from disagg.api.protocol import (
    ErrorResponse,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ModelReady,
    ServerLive,
    ServerMetadata,
    ServerReady,
    decode_dlrm_request,
    dlrm_model_metadata,
    encode_dlrm_request,
    encode_dlrm_response,
)
from disagg.config import DLRMAppConfig
from disagg.model import DLRMSpec
from serving.common.auth import api_key_dependencies
from serving.common.constants import SERVER_NAME
from serving.common.http import APIError, edit_openapi, error_responses, install_error_handling

#: The one version every served DLRM has; weights are fixed by (preset, seed) for the app's lifetime.
MODEL_VERSION = "1"


class DLRMBackend(Protocol):
    """What the API needs from whatever runs the model (one replica, or split CPU/GPU pools)."""

    @property
    def spec(self) -> DLRMSpec:
        """Architecture of the served model: input widths and embedding table sizes."""
        ...

    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Probabilities [B, 1] for validated ``dense`` float32 [B, num_dense] and ``sparse`` int64
        [B, num_tables, H] (-1: empty slot; H may differ between calls)."""
        ...

    def ready(self) -> bool:
        """Whether ``infer`` can succeed now (e.g. every embedding shard has a replica)."""
        ...


_SCHEMA_REF = "#/components/schemas/{model}"
_INFER_DESCRIPTION = f"""Runs the model on a batch of rows.

The body is JSON (an `InferRequest`), or, with the binary tensor data extension, the header
`{HEADER_LENGTH}: N` says the first N bytes are that JSON and raw little-endian tensor bytes follow, one
block per input that sets `parameters.binary_data_size` (in input order) instead of `data`. Outputs come
back as binary data when the request sets `parameters.binary_data_output` or an output's
`parameters.binary_data`; such a response is `{BINARY_MEDIA_TYPE}` with the same header.

`sparse_features` is [batch, tables, ids_per_table] (multi-hot, sum-pooled; -1 marks an empty slot) or
[batch, tables] for one id per table; INT64 or INT32."""
_BINARY_SCHEMA = {"schema": {"type": "string", "format": "binary"}}
_HEADER_LENGTH_SCHEMA = {"type": "string", "pattern": "^[0-9]+$"}


_INFER_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "description": f"The outputs: JSON, or `{BINARY_MEDIA_TYPE}` when binary outputs were asked for.",
        "content": {BINARY_MEDIA_TYPE: _BINARY_SCHEMA},
        "headers": {
            HEADER_LENGTH: {
                "description": "Bytes of JSON before the binary outputs (binary responses).",
                "schema": _HEADER_LENGTH_SCHEMA,
            }
        },
    }
}


def _infer_openapi(spec: DLRMSpec) -> dict[str, Any]:
    """The infer routes' header and body in OpenAPI, with examples that work on a model of ``spec``."""
    row = encode_dlrm_request(
        torch.zeros(1, spec.num_dense), torch.zeros(1, spec.num_tables, dtype=torch.int64), request_id="example"
    ).model_dump(exclude_none=True)
    examples = {
        "one_row": {"summary": "One row; JSON outputs", "value": row},
        "binary_outputs": {
            "summary": f"One row; outputs as binary data ({BINARY_MEDIA_TYPE} response)",
            "value": row | {"parameters": {"binary_data_output": True}},
        },
    }
    header = {
        "name": HEADER_LENGTH,
        "in": "header",
        "required": False,
        "description": "Binary tensor data extension: bytes of JSON at the start of the body.",
        "schema": _HEADER_LENGTH_SCHEMA,
    }
    body_schema = {"$ref": _SCHEMA_REF.format(model=InferRequest.__name__)}
    return {
        "parameters": [header],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": body_schema, "examples": examples},
                BINARY_MEDIA_TYPE: _BINARY_SCHEMA,
            },
        },
    }


def _publish_infer_request_schema(schema: dict[str, Any]) -> None:
    """Adds ``InferRequest`` and its parts, as requests see them, to the OpenAPI components: infer routes
    parse their bodies themselves (JSON or binary), so FastAPI does not know the schema."""
    _, definitions = models_json_schema([(InferRequest, "validation")], ref_template=_SCHEMA_REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])


def render_oip_error(error: APIError) -> JSONResponse:
    """Errors in OIP shape: ``{"error": "<message>"}``."""
    body = ErrorResponse(error=error.message)
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


def _server_version() -> str:
    try:
        return package_metadata.version("swiftserve")
    except package_metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def create_oip_api(backend: DLRMBackend, config: DLRMAppConfig, *, api_key: str = "") -> FastAPI:
    """FastAPI app serving ``backend`` as model ``config.model_name`` over OIP v2; a non-empty ``api_key``
    (deployments pass ``constants.API_KEY``) makes all but the health probes need it as a bearer token."""
    version = _server_version()
    app = FastAPI(title=f"{SERVER_NAME} DLRM (Open Inference Protocol v2)", version=version)
    install_error_handling(app, render_oip_error, max_body_bytes=config.limits.max_body_bytes)
    edit_openapi(app, _publish_infer_request_schema)
    protected = api_key_dependencies(api_key)
    unauthorized = (401,) if api_key else ()
    not_ready = {"description": "Not ready: requests would fail now (e.g. an embedding shard has no replica)."}
    server_metadata = ServerMetadata(name=SERVER_NAME, version=version, extensions=["binary_tensor_data"])
    model_metadata = dlrm_model_metadata(config.model_name, MODEL_VERSION, backend.spec)
    # The one model and version served; any other name in a path is a 404.
    model_name_param = Path(description="Name of the served model.", json_schema_extra={"enum": [config.model_name]})
    version_param = Path(description="Version of the served model.", json_schema_extra={"enum": [MODEL_VERSION]})

    def require_model(model_name: str, model_version: str | None = None) -> None:
        if model_name != config.model_name:
            raise APIError(
                404,
                f"model {model_name!r} not found; this server serves {config.model_name!r}",
                param="model_name",
                code="model_not_found",
            )
        if model_version is not None and model_version != MODEL_VERSION:
            raise APIError(
                404,
                f"model {model_name!r} has no version {model_version!r}; versions: {MODEL_VERSION!r}",
                param="model_version",
                code="model_not_found",
            )

    async def infer(http_request: Request, model_name: str, model_version: str | None) -> Response:
        require_model(model_name, model_version)
        parsed = parse_infer_request(await http_request.body(), http_request.headers.get(HEADER_LENGTH))
        inputs = decode_dlrm_request(parsed.request, backend.spec, config.limits, parsed.binary_inputs)
        probabilities = await backend.infer(inputs.dense, inputs.sparse)
        response = encode_dlrm_response(
            probabilities, model_name=model_name, model_version=MODEL_VERSION, request_id=parsed.request.id
        )
        body, header_length = encode_infer_response(response, parsed.binary_outputs)
        if header_length is None:
            return Response(body, media_type="application/json")
        return Response(body, media_type=BINARY_MEDIA_TYPE, headers={HEADER_LENGTH: str(header_length)})

    metadata_errors = error_responses(ErrorResponse, *unauthorized, 404)

    @app.get(
        "/",
        response_model=ServerMetadata,
        dependencies=protected,
        responses=error_responses(ErrorResponse, *unauthorized),
    )
    # `GET /v2` under Serve's route prefix /v2
    @app.get("", response_model=ServerMetadata, include_in_schema=False, dependencies=protected)
    async def get_server_metadata() -> ServerMetadata:
        return server_metadata

    @app.get("/health/live", response_model=ServerLive)
    async def live() -> ServerLive:
        return ServerLive(live=True)

    def readiness(body: dict[str, str | bool]) -> JSONResponse:
        ready = backend.ready()
        return JSONResponse({**body, "ready": ready}, status_code=200 if ready else 503)

    @app.get("/health/ready", response_model=ServerReady, responses={503: {"model": ServerReady, **not_ready}})
    async def ready() -> JSONResponse:
        return readiness({})

    @app.get(
        "/models/{model_name}",
        response_model=ModelMetadata,
        response_model_exclude_none=True,
        dependencies=protected,
        responses=metadata_errors,
    )
    async def get_model_metadata(model_name: str = model_name_param) -> ModelMetadata:
        require_model(model_name)
        return model_metadata

    @app.get(
        "/models/{model_name}/versions/{model_version}",
        response_model=ModelMetadata,
        response_model_exclude_none=True,
        dependencies=protected,
        responses=metadata_errors,
    )
    async def get_model_version_metadata(
        model_name: str = model_name_param, model_version: str = version_param
    ) -> ModelMetadata:
        require_model(model_name, model_version)
        return model_metadata

    model_ready_responses = {**metadata_errors, 503: {"model": ModelReady, **not_ready}}

    @app.get(
        "/models/{model_name}/ready", response_model=ModelReady, dependencies=protected, responses=model_ready_responses
    )
    async def model_ready(model_name: str = model_name_param) -> JSONResponse:
        require_model(model_name)
        return readiness({"name": model_name})

    @app.get(
        "/models/{model_name}/versions/{model_version}/ready",
        response_model=ModelReady,
        dependencies=protected,
        responses=model_ready_responses,
    )
    async def model_version_ready(
        model_name: str = model_name_param, model_version: str = version_param
    ) -> JSONResponse:
        require_model(model_name, model_version)
        return readiness({"name": model_name})

    infer_responses = {**_INFER_OK, **error_responses(ErrorResponse, 400, *unauthorized, 404, 413, 503)}
    infer_openapi = _infer_openapi(backend.spec)

    @app.post(
        "/models/{model_name}/infer",
        response_model=InferResponse,
        description=_INFER_DESCRIPTION,
        openapi_extra=infer_openapi,
        dependencies=protected,
        responses=infer_responses,
    )
    async def infer_latest(request: Request, model_name: str = model_name_param) -> Response:
        return await infer(request, model_name, None)

    @app.post(
        "/models/{model_name}/versions/{model_version}/infer",
        response_model=InferResponse,
        description=_INFER_DESCRIPTION,
        openapi_extra=infer_openapi,
        dependencies=protected,
        responses=infer_responses,
    )
    async def infer_version(
        request: Request, model_name: str = model_name_param, model_version: str = version_param
    ) -> Response:
        return await infer(request, model_name, model_version)

    return app
