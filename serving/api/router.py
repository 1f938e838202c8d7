"""Routes of the OpenAI-compatible Images API: short handlers over the served models in ``app.state``."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends

from serving.api.models import ServedModels
from serving.api.protocol import ErrorResponse, ImageGenerationRequest, ImageGenerationResponse, ModelList
from serving.common.errors import APIError
from serving.common.http import JSONRoute, app_state, error_responses

Models = Annotated[ServedModels, Depends(app_state("models"))]

#: Inference and model listing: the app guards them with the API key when one is set. Both routers parse JSON
#: bodies as ``install_error_handling`` documents (an included route keeps its own router's route class).
router = APIRouter(route_class=JSONRoute)
#: The probe, always open.
health_router = APIRouter(route_class=JSONRoute)


@router.post("/v1/images/generations", response_model=ImageGenerationResponse,
             responses=error_responses(ErrorResponse, 400, 404, 413, 422, 503))
async def generate_images(request: ImageGenerationRequest, models: Models) -> ImageGenerationResponse:
    started = time.perf_counter()
    model = models.pick(request.model)
    params = request.to_params(await model.backend.model_info(), model.config)
    try:
        result = await model.backend.generate(params)
    except APIError as error:
        requested = {"loras": [lora.name for lora in request.loras],
                     "controlnets": [controlnet.name for controlnet in request.controlnets]}
        raise await models.explain_missing(error, model, requested) from None
    return ImageGenerationResponse.from_result(result, total_s=time.perf_counter() - started)


@router.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)
async def list_models(models: Models) -> ModelList:
    return ModelList(data=await models.cards())


@health_router.get("/health")
async def health(models: Models) -> dict[str, str]:
    for model in models.all:
        await model.backend.model_info()
    return {"status": "ok"}
