"""OIP v2 HTTP API for one DLRM, independent of how and where the model runs.

Routes carry no ``/v2`` prefix: Ray Serve mounts the app under the route prefix ``/v2``.
"""

from __future__ import annotations

from importlib import metadata as package_metadata
from typing import Protocol

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from disagg.config import DLRMAppConfig
from disagg.model import DLRMSpec
from disagg.protocol import (
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    decode_dlrm_request,
    dlrm_model_metadata,
    encode_dlrm_response,
)
from serving.common.constants import SERVER_NAME
from serving.common.http import APIError, install_error_handling

#: The one version every served DLRM has; weights are fixed by (preset, seed) for the app's lifetime.
MODEL_VERSION = "1"


class DLRMBackend(Protocol):
    """What the API needs from whatever runs the model (one replica, or split CPU/GPU pools)."""

    @property
    def spec(self) -> DLRMSpec:
        """Architecture of the served model: input widths and embedding table sizes."""
        ...

    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Probabilities [B, 1] for validated ``dense`` [B, num_dense] and ``sparse`` [B, num_tables]."""
        ...


def render_oip_error(error: APIError) -> JSONResponse:
    """Errors in OIP shape: ``{"error": "<message>"}``."""
    return JSONResponse({"error": error.message}, status_code=error.status_code, headers=error.headers)


def _server_version() -> str:
    try:
        return package_metadata.version("swiftserve")
    except package_metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def create_oip_api(backend: DLRMBackend, config: DLRMAppConfig) -> FastAPI:
    """FastAPI app serving ``backend`` as model ``config.model_name`` over OIP v2."""
    version = _server_version()
    app = FastAPI(title=f"{SERVER_NAME} DLRM (Open Inference Protocol v2)", version=version)
    install_error_handling(app, render_oip_error, max_body_bytes=config.limits.max_body_bytes)
    server_metadata = ServerMetadata(name=SERVER_NAME, version=version, extensions=[])
    model_metadata = dlrm_model_metadata(config.model_name, MODEL_VERSION, backend.spec)

    def require_model(model_name: str, model_version: str | None = None) -> None:
        if model_name != config.model_name:
            raise APIError(404, f"model {model_name!r} not found; this server serves {config.model_name!r}",
                           param="model_name", code="model_not_found")
        if model_version is not None and model_version != MODEL_VERSION:
            raise APIError(404, f"model {model_name!r} has no version {model_version!r}; "
                           f"versions: {MODEL_VERSION!r}", param="model_version", code="model_not_found")

    async def infer(request: InferRequest, model_name: str, model_version: str | None) -> InferResponse:
        require_model(model_name, model_version)
        inputs = decode_dlrm_request(request, backend.spec, max_rows=config.limits.max_rows_per_request)
        probabilities = await backend.infer(inputs.dense, inputs.sparse)
        return encode_dlrm_response(probabilities, model_name=model_name, model_version=MODEL_VERSION,
                                    request_id=request.id)

    @app.get("/", response_model=ServerMetadata)
    async def get_server_metadata() -> ServerMetadata:
        return server_metadata

    @app.get("/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.get("/models/{model_name}", response_model=ModelMetadata, response_model_exclude_none=True)
    async def get_model_metadata(model_name: str) -> ModelMetadata:
        require_model(model_name)
        return model_metadata

    @app.get("/models/{model_name}/versions/{model_version}", response_model=ModelMetadata,
             response_model_exclude_none=True)
    async def get_model_version_metadata(model_name: str, model_version: str) -> ModelMetadata:
        require_model(model_name, model_version)
        return model_metadata

    @app.get("/models/{model_name}/ready")
    async def model_ready(model_name: str) -> dict[str, str | bool]:
        require_model(model_name)
        return {"name": model_name, "ready": True}

    @app.get("/models/{model_name}/versions/{model_version}/ready")
    async def model_version_ready(model_name: str, model_version: str) -> dict[str, str | bool]:
        require_model(model_name, model_version)
        return {"name": model_name, "ready": True}

    @app.post("/models/{model_name}/infer", response_model=InferResponse, response_model_exclude_none=True)
    async def infer_latest(model_name: str, request: InferRequest) -> InferResponse:
        return await infer(request, model_name, None)

    @app.post("/models/{model_name}/versions/{model_version}/infer", response_model=InferResponse,
              response_model_exclude_none=True)
    async def infer_version(model_name: str, model_version: str, request: InferRequest) -> InferResponse:
        return await infer(request, model_name, model_version)

    return app
