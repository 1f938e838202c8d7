"""The HTTP ingress of the diffusion app and the engine interface it serves, over a handle to each model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serving.api.models import ServedModel, ServedModels
from serving.api.server import create_images_api
from serving.common.backpressure import OVERLOADED, queue_full
from serving.common.constants import API_KEY
from serving.common.device import placement
from serving.common.errors import APIError, retry_after
from serving.common.logging import get_logger
from serving.config import ImagesAppConfig
from serving.engine import GenerationEvent, GenerationParams, GenerationResult, ImageGenerationBackend, ModelInfo

logger = get_logger("deployments.ingress")


class DeploymentBackend(ImageGenerationBackend):
    """The engine interface over a handle to ``DiffusionModel`` (or to ``DiffusionModelGroup``, each call naming
    ``model``). A full model queue and a replica dying under a call are 503s with ``Retry-After``; a dead replica's
    call is not retried (the generation may be what killed it)."""

    def __init__(self, handle: DeploymentHandle, model: str | None = None) -> None:
        self._handle = handle
        self._model = () if model is None else (model,)
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self._call("model_info")
        return self._info

    async def list_loras(self) -> list[str]:
        return await self._call("list_loras")

    async def list_controlnets(self) -> list[str]:
        return await self._call("list_controlnets")

    async def generate(self, params: GenerationParams) -> GenerationResult:
        return await self._call("generate", params)

    async def generate_stream(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """The replica's ``generate_stream`` over a streaming handle call; leaving before its end (closed,
        cancelled) cancels the call, which cancels the request in the replica."""
        stream = self._handle.options(stream=True).generate_stream.remote(*self._model, params)
        finished = False
        try:
            with _mapped_errors("generate_stream"):
                async for event in stream:
                    if isinstance(event, APIError):  # the model's answer to a request it refused
                        raise event
                    yield event
            finished = True
        finally:
            if not finished:
                stream.cancel()

    async def _call(self, method: str, *args: Any) -> Any:
        with _mapped_errors(method):
            result = await getattr(self._handle, method).remote(*self._model, *args)
        if isinstance(result, APIError):  # the model's answer to a request it refused
            raise result
        return result


@contextmanager
def _mapped_errors(method: str) -> Iterator[None]:
    """Ray's errors of a ``method`` call as the API answers them: Serve's backpressure and a dead replica are 503s
    with ``Retry-After``; an ``APIError`` the replica raised is raised as it is."""
    try:
        yield
    except BackPressureError as exc:
        raise queue_full(exc.retry_after_s or 1, exc.status_code) from None
    except RayActorError as exc:
        logger.warning("model replica failed under a %s call: %s", method, exc)
        raise APIError(503, "the model replica serving this request failed; retry", code="replica_failed",
                       headers=retry_after(1)) from None
    except RayTaskError as exc:
        if isinstance(exc.cause, APIError):
            raise exc.cause from None
        raise


def served_models(handles: list[DeploymentHandle], config: ImagesAppConfig) -> ServedModels:
    """Each model's ``DiffusionModel`` handle as the API's backend for it (``handles`` in ``config.models``' order),
    or with ``shared_replicas`` the one ``DiffusionModelGroup`` handle, naming each model."""
    if config.shared_replicas:
        (group,) = handles
        return ServedModels([ServedModel(DeploymentBackend(group, entry.model.name), entry)
                             for entry in config.models])
    return ServedModels([ServedModel(DeploymentBackend(handle), entry)
                         for handle, entry in zip(handles, config.models, strict=True)])


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=64, max_queued_requests=64,
                  backpressure_config=OVERLOADED)
@serve.ingress()
class ImagesIngress:
    """The OpenAI Images HTTP API; forwards each generation to the ``DiffusionModel`` deployment of the model it
    names (``models``: a handle per model, in ``config``'s order), or to ``DiffusionModelGroup`` (one handle)."""

    def __init__(self, models: list[DeploymentHandle], config: ImagesAppConfig) -> None:
        self._models = served_models(models, config)
        logger.info("images ingress up on %s, serving %s", placement(),
                    ", ".join(model.name for model in self._models.all))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_images_api(self._models, api_key=API_KEY)
