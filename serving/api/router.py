"""Routes of the OpenAI-compatible Images API: short handlers over the served models in ``app.state``."""

from __future__ import annotations

import time
from typing import Annotated, Any, get_args

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from serving.api.edits import EDITS_PATH, EditForm, read_edit_form
from serving.api.models import ServedModel, ServedModels
from serving.api.protocol import (
    ErrorResponse,
    ImageCompletedEvent,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelList,
    PartialImageEvent,
    StreamErrorEvent,
    StreamKind,
)
from serving.api.streaming import stream_images
from serving.common.errors import APIError
from serving.common.http import JSONRoute, app_state, error_responses
from serving.engine import GenerationParams

Models = Annotated[ServedModels, Depends(app_state("models"))]

#: Inference and model listing: the app guards them with the API key when one is set. Both routers parse JSON
#: bodies as ``install_error_handling`` documents (an included route keeps its own router's route class).
router = APIRouter(route_class=JSONRoute)
#: The probe, always open.
health_router = APIRouter(route_class=JSONRoute)

_STREAM_EVENTS = (PartialImageEvent, ImageCompletedEvent, StreamErrorEvent)
#: One server-sent event of a stream (before OpenAPI 3.2, a stream's ``schema`` describes each of its events).
_STREAM_EVENT_SCHEMA = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": [name for event in _STREAM_EVENTS
                                             for name in get_args(event.model_fields["type"].annotation)]},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "description": "The event as one line of JSON, its `type` the event's name."},
    },
}
_IMAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The images; with `stream: true`, server-sent events instead: `<kind>.partial_image` per "
                         "preview, then `<kind>.completed` per image (`<kind>`: `image_generation`, `image_edit`), "
                         "or `error` if the request fails after its first event.",
          "content": {"text/event-stream": {"schema": _STREAM_EVENT_SCHEMA}}},
    **error_responses(ErrorResponse, 400, 404, 413, 422, 503),
}


@router.post("/v1/images/generations", response_model=ImageGenerationResponse, responses=_IMAGE_RESPONSES)
async def generate_images(request: ImageGenerationRequest, models: Models) -> ImageGenerationResponse | Response:
    started = time.perf_counter()
    model = models.pick(request.model)
    params = request.to_params(await model.backend.model_info(), model.config)
    return await _answer(models, model, request, params, "image_generation", started)


@router.post(EDITS_PATH, response_model=ImageGenerationResponse, responses=_IMAGE_RESPONSES)
async def edit_images(form: Annotated[EditForm, Depends(read_edit_form)],
                      models: Models) -> ImageGenerationResponse | Response:
    started = time.perf_counter()
    model = models.pick(form.request.model)
    params = form.request.to_params(await model.backend.model_info(), model.config, form.image, form.mask)
    return await _answer(models, model, form.request, params, "image_edit", started)


async def _answer(models: ServedModels, model: ServedModel, request: ImageGenerationRequest | ImageEditRequest,
                  params: GenerationParams, kind: StreamKind, started: float) -> ImageGenerationResponse | Response:
    """Runs ``params`` on ``model``: the images, or with ``stream`` their events; a refusal before the first event
    is raised (a LoRA or ControlNet another model serves as that model's 422)."""
    try:
        if request.stream:
            return await stream_images(model.backend.generate_stream(params), kind,
                                       f"{params.width}x{params.height}", started)
        result = await model.backend.generate(params)
    except APIError as error:
        raise await models.explain_missing(error, model, request.requested_items()) from None
    return ImageGenerationResponse.from_result(result, total_s=time.perf_counter() - started)


@router.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)
async def list_models(models: Models) -> ModelList:
    return ModelList(data=await models.cards())


@health_router.get("/health")
async def health(models: Models) -> dict[str, str]:
    for model in models.all:
        await model.backend.model_info()
    return {"status": "ok"}
