"""The diffusion app's OpenAI-compatible HTTP API: a FastAPI app over the served models, each an
``ImageGenerationBackend``.

Inside Ray Serve a backend is a handle to a model deployment; in unit tests, an in-process engine.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from serving.api.edits import document_edit_form
from serving.api.models import ServedModels
from serving.api.protocol import ErrorBody, ErrorResponse
from serving.api.router import health_router, router
from serving.common.auth import api_key_dependencies
from serving.common.errors import APIError
from serving.common.http import edit_openapi, error_responses, install_error_handling


def render_openai_error(error: APIError) -> Response:
    """``{"error": {message, type, param, code}}`` as OpenAI sends it."""
    body = ErrorResponse(error=ErrorBody.of(error))
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


def create_images_api(models: ServedModels, *, api_key: str = "") -> FastAPI:
    """The Images API over ``models``; with a non-empty ``api_key``, inference and model listing need it."""
    app = FastAPI(
        title="swiftserve diffusion",
        description="OpenAI Images API compatible text-to-image and image editing serving.",
        version="1",
    )
    app.state.models = models
    install_error_handling(app, render_openai_error, max_body_bytes=models.max_body_bytes)
    app.include_router(router, dependencies=api_key_dependencies(api_key),
                       responses=error_responses(ErrorResponse, 401) if api_key else None)
    app.include_router(health_router)
    edit_openapi(app, document_edit_form)
    return app
