"""Routes of the OpenAI-compatible Images API: short handlers over the backend and config in ``app.state``."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends

from serving.api.protocol import ErrorResponse, ImageGenerationRequest, ImageGenerationResponse, ModelCard, ModelList
from serving.common.constants import SERVER_NAME
from serving.common.http import JSONRoute, app_state, error_responses
from serving.config import DiffusionAppConfig
from serving.engine import ImageGenerationBackend

Backend = Annotated[ImageGenerationBackend, Depends(app_state("backend"))]
Config = Annotated[DiffusionAppConfig, Depends(app_state("config"))]

#: Inference and model listing: the app guards them with the API key when one is set. Both routers parse JSON
#: bodies as ``install_error_handling`` documents (an included route keeps its own router's route class).
router = APIRouter(route_class=JSONRoute)
#: The probe, always open.
health_router = APIRouter(route_class=JSONRoute)


@router.post("/v1/images/generations", response_model=ImageGenerationResponse,
             responses=error_responses(ErrorResponse, 400, 404, 413, 422, 503))
async def generate_images(request: ImageGenerationRequest, backend: Backend, config: Config) -> ImageGenerationResponse:
    started = time.perf_counter()
    params = request.to_params(await backend.model_info(), config)
    result = await backend.generate(params)
    return ImageGenerationResponse.from_result(result, total_s=time.perf_counter() - started)


@router.get("/v1/models", response_model=ModelList)
async def list_models(backend: Backend) -> ModelList:
    info = await backend.model_info()
    cards = [ModelCard(id=info.name, owned_by=SERVER_NAME, kind="base-model")]
    cards += [ModelCard(id=name, owned_by=SERVER_NAME, kind="controlnet") for name in await backend.list_controlnets()]
    cards += [ModelCard(id=name, owned_by=SERVER_NAME, kind="lora") for name in await backend.list_loras()]
    return ModelList(data=cards)


@health_router.get("/health")
async def health(backend: Backend) -> dict[str, str]:
    await backend.model_info()
    return {"status": "ok"}
