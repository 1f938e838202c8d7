"""``LocalBackend``: the engine interface over an in-process engine loop (a Serve replica or a test).

Engine, LoRA and ControlNet errors are ``APIError``s already; here one naming a request item gets its position.
"""

from __future__ import annotations

import asyncio

from serving.common.errors import RequestItemError
from serving.common.metrics import NO_METRICS, Metrics
from serving.config import DiffusionAppConfig
from serving.controlnet.client import ControlNetClient
from serving.engine.cfg import CFGWorker
from serving.engine.diffusion_engine import DiffusionEngine
from serving.engine.loop import EngineLoop, StepCallback
from serving.engine.types import GenerationParams, GenerationResult, ImageGenerationBackend, ModelInfo
from serving.lora.cache import LoRACache
from serving.lora.registry import LoRARegistry


class LocalBackend(ImageGenerationBackend):
    """Serves one model: submits requests to the engine loop and awaits their futures."""

    def __init__(self, loop: EngineLoop, metrics: Metrics = NO_METRICS) -> None:
        self.loop = loop
        self._metrics = metrics

    @classmethod
    def from_config(cls, config: DiffusionAppConfig, *, controlnets: ControlNetClient | None = None,
                    cfg_worker: CFGWorker | None = None, on_step: StepCallback | None = None,
                    metrics: Metrics = NO_METRICS) -> LocalBackend:
        engine = DiffusionEngine.from_config(config.model, config.lora, controlnets, cfg_worker, metrics)
        return cls.for_engine(engine, config, on_step=on_step, metrics=metrics)

    @staticmethod
    def lora_cache_for(engine: DiffusionEngine, config: DiffusionAppConfig,
                       metrics: Metrics = NO_METRICS) -> LoRACache | None:
        """The LoRA cache ``config`` asks for, validated against ``engine``'s modules (None: no LoRAs)."""
        directory = config.lora_directory()
        if directory is None:
            return None
        return LoRACache(LoRARegistry(directory), engine.lora_targets,
                         budget_bytes=config.lora.cache_bytes, max_file_bytes=config.lora.max_file_bytes,
                         max_header_bytes=config.lora.max_header_bytes, max_tensors=config.lora.max_tensors,
                         max_workers=config.lora.load_workers, metrics=metrics)

    @classmethod
    def for_engine(cls, engine: DiffusionEngine, config: DiffusionAppConfig, *,
                   on_step: StepCallback | None = None, metrics: Metrics = NO_METRICS) -> LocalBackend:
        """A backend over ``engine``; its loop, LoRA cache and requests record into ``metrics``."""
        cache = cls.lora_cache_for(engine, config, metrics)
        return cls(EngineLoop(engine, config.engine, cache, on_step=on_step, metrics=metrics), metrics)

    async def model_info(self) -> ModelInfo:
        return self.loop.engine.info

    async def list_loras(self) -> list[str]:
        """The LoRA directory's LoRAs of this model's family (by their file headers)."""
        cache = self.loop.lora_cache
        return await asyncio.to_thread(cache.names) if cache is not None else []

    async def list_controlnets(self) -> list[str]:
        controlnets = self.loop.engine.controlnets
        return controlnets.names() if controlnets is not None else []

    async def generate(self, params: GenerationParams) -> GenerationResult:
        with self._metrics.request("diffusion_generation"):
            return await self._generate(params)

    async def _generate(self, params: GenerationParams) -> GenerationResult:
        try:
            return await asyncio.wrap_future(self.loop.submit(params))
        except RequestItemError as error:  # ``loras[2].name``: where this request names the item
            raise error.located([item.name for item in getattr(params, error.field)]) from None

    def close(self) -> None:
        self.loop.stop()
        if self.loop.lora_cache is not None:
            self.loop.lora_cache.close()
