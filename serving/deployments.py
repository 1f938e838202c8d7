"""Ray Serve deployments of the diffusion application.

``ImagesIngress`` (HTTP, FastAPI) --handle--> ``DiffusionModel`` (one engine per replica).
The two scale independently; later ControlNet services and CFG workers hang off the model replica.
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle

from serving.api import create_images_api
from serving.common.device import placement
from serving.common.http import APIError
from serving.common.logging import get_logger
from serving.config import DiffusionAppConfig
from serving.engine import GenerationParams, GenerationResult, LocalBackend, ModelInfo

logger = get_logger("deployments")


@serve.deployment(ray_actor_options={"num_cpus": 1})
class DiffusionModel:
    """One diffusion engine and its LoRA cache; requests are batched step by step by the engine loop."""

    def __init__(self, config: DiffusionAppConfig) -> None:
        self._backend = LocalBackend.from_config(config)

    async def model_info(self) -> ModelInfo:
        return await self._backend.model_info()

    async def list_loras(self) -> list[str]:
        return await self._backend.list_loras()

    async def generate(self, params: GenerationParams) -> GenerationResult:
        return await self._backend.generate(params)

    def __del__(self) -> None:  # Serve calls this on graceful replica shutdown
        backend = getattr(self, "_backend", None)
        if backend is not None:
            backend.close()


class DeploymentBackend:
    """``ImageGenerationBackend`` over a handle to ``DiffusionModel``."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self._handle.model_info.remote()
        return self._info

    async def list_loras(self) -> list[str]:
        return await self._handle.list_loras.remote()

    async def generate(self, params: GenerationParams) -> GenerationResult:
        try:
            return await self._handle.generate.remote(params)
        except RayTaskError as exc:
            if isinstance(exc.cause, APIError):
                raise exc.cause from None
            raise


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
@serve.ingress()
class ImagesIngress:
    """The OpenAI Images HTTP API; forwards generations to ``DiffusionModel``."""

    def __init__(self, model: DeploymentHandle, config: DiffusionAppConfig) -> None:
        self._backend = DeploymentBackend(model)
        self._config = config
        logger.info("images ingress up on %s", placement())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_images_api(self._backend, self._config)
