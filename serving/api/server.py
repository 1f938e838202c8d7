"""The OpenAI-compatible HTTP API of the diffusion application, as a FastAPI app over a backend.

``create_images_api`` depends only on ``ImageGenerationBackend``: inside Ray Serve the backend is a
handle to the model deployment, in unit tests an in-process engine.

API-key auth (``serving.common.auth``): with ``api_key`` set, ``/v1/images/generations`` and ``/v1/models``
need ``Authorization: Bearer <key>``, else 401 in OpenAI's shape (``type`` ``invalid_request_error``,
``code`` ``invalid_api_key``) with ``WWW-Authenticate: Bearer``; ``/health`` and the docs stay open.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from serving.api.protocol import (
    ErrorBody,
    ErrorResponse,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelCard,
    ModelList,
)
from serving.common.auth import api_key_dependencies
from serving.common.constants import SERVER_NAME
from serving.common.http import APIError, error_responses, install_error_handling
from serving.config import DiffusionAppConfig
from serving.engine import ImageGenerationBackend

#: OpenAI answers a missing or wrong API key with 401 and type ``invalid_request_error``.
_ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def render_openai_error(error: APIError) -> Response:
    """``{"error": {message, type, param, code}}`` as OpenAI sends it."""
    fallback = "invalid_request_error" if error.status_code < 500 else "server_error"
    kind = _ERROR_TYPES.get(error.status_code, fallback)
    body = ErrorResponse(error=ErrorBody(message=error.message, type=kind, param=error.param, code=error.code))
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


def create_images_api(backend: ImageGenerationBackend, config: DiffusionAppConfig, *, api_key: str = "") -> FastAPI:
    """The ``/v1/images/generations``, ``/v1/models`` and ``/health`` routes over ``backend``; a non-empty
    ``api_key`` (deployments pass ``constants.API_KEY``) makes all but ``/health`` need it as a bearer token."""
    app = FastAPI(
        title="swiftserve diffusion",
        description="OpenAI Images API compatible text-to-image serving.",
        version="1",
    )
    install_error_handling(app, render_openai_error, max_body_bytes=config.limits.max_body_bytes)
    protected = api_key_dependencies(api_key)
    unauthorized = (401,) if api_key else ()

    @app.post(
        "/v1/images/generations",
        response_model=ImageGenerationResponse,
        dependencies=protected,
        responses=error_responses(ErrorResponse, 400, *unauthorized, 404, 413, 422, 503),
    )
    async def generate_images(request: ImageGenerationRequest) -> ImageGenerationResponse:
        started = time.perf_counter()
        params = request.to_params(await backend.model_info(), config)
        result = await backend.generate(params)
        return ImageGenerationResponse.from_result(result, total_s=time.perf_counter() - started)

    @app.get("/v1/models", response_model=ModelList, dependencies=protected,
             responses=error_responses(ErrorResponse, *unauthorized))
    async def list_models() -> ModelList:
        info = await backend.model_info()
        cards = [ModelCard(id=info.name, owned_by=SERVER_NAME, kind="base-model")]
        cards += [ModelCard(id=name, owned_by=SERVER_NAME, kind="controlnet")
                  for name in await backend.list_controlnets()]
        cards += [ModelCard(id=name, owned_by=SERVER_NAME, kind="lora") for name in await backend.list_loras()]
        return ModelList(data=cards)

    @app.get("/health")
    async def health() -> dict[str, str]:
        await backend.model_info()
        return {"status": "ok"}

    return app
