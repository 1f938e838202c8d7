"""Ray Serve deployments of the diffusion application.

``ImagesIngress`` (HTTP, FastAPI) --handle--> ``DiffusionModel`` (one engine per replica).
The two scale independently; later ControlNet services and CFG workers hang off the model replica.
"""

from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.api import create_images_api
from serving.common.device import placement
from serving.common.logging import get_logger
from serving.config import DiffusionAppConfig
from serving.engine import DiffusionEngine, GenerationParams, GenerationResult, LocalBackend, ModelInfo

logger = get_logger("deployments")


@serve.deployment(ray_actor_options={"num_cpus": 1})
class DiffusionModel:
    """One diffusion engine; generations on a replica run one at a time."""

    def __init__(self, config: DiffusionAppConfig) -> None:
        self._backend = LocalBackend(DiffusionEngine.from_config(config.model))

    async def model_info(self) -> ModelInfo:
        return await self._backend.model_info()

    async def generate(self, params: GenerationParams) -> GenerationResult:
        return await self._backend.generate(params)


class DeploymentBackend:
    """``ImageGenerationBackend`` over a handle to ``DiffusionModel``."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self._handle.model_info.remote()
        return self._info

    async def generate(self, params: GenerationParams) -> GenerationResult:
        return await self._handle.generate.remote(params)


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
