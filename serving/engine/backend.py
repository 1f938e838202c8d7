"""``LocalBackend``: the engine interface over an in-process engine loop (a Serve replica or a test).

This is the boundary where engine and LoRA errors become API errors (status, message, field).
"""

from __future__ import annotations

import asyncio

from serving.common.http import APIError
from serving.config import DiffusionAppConfig
from serving.engine.denoiser import DiffusionEngine
from serving.engine.loop import EngineLoop, LoRALoadFailed, StepCallback
from serving.engine.types import GenerationParams, GenerationResult, ModelInfo
from serving.lora.cache import LoRACache
from serving.lora.registry import InvalidLoRAName, LoRANotFound, LoRARegistry


def _lora_param(params: GenerationParams, name: str) -> str:
    for index, spec in enumerate(params.loras):
        if spec.name == name:
            return f"loras[{index}].name"
    return "loras"


class LocalBackend:
    """Serves one model: submits requests to the engine loop and awaits their futures."""

    def __init__(self, loop: EngineLoop, registry: LoRARegistry | None = None) -> None:
        self.loop = loop
        self.registry = registry

    @classmethod
    def from_config(cls, config: DiffusionAppConfig, *, on_step: StepCallback | None = None) -> LocalBackend:
        engine = DiffusionEngine.from_config(config.model, config.lora)
        return cls.for_engine(engine, config, on_step=on_step)

    @classmethod
    def for_engine(cls, engine: DiffusionEngine, config: DiffusionAppConfig, *,
                   on_step: StepCallback | None = None) -> LocalBackend:
        registry = cache = None
        if config.lora.directory is not None:
            registry = LoRARegistry(config.lora.directory)
            cache = LoRACache(registry, engine.lora_targets, budget_bytes=config.lora.cache_bytes,
                              max_file_bytes=config.lora.max_file_bytes, max_workers=config.lora.load_workers)
        return cls(EngineLoop(engine, config.engine, cache, on_step=on_step), registry)

    async def model_info(self) -> ModelInfo:
        return self.loop.engine.info

    async def list_loras(self) -> list[str]:
        return await asyncio.to_thread(self.registry.names) if self.registry is not None else []

    async def generate(self, params: GenerationParams) -> GenerationResult:
        try:
            future = self.loop.submit(params)
        except InvalidLoRAName as exc:
            raise APIError(400, f"invalid LoRA name: {exc}", param=_lora_param(params, exc.name),
                           code="invalid_lora_name") from None
        except LoRANotFound as exc:
            raise APIError(404, f"LoRA {exc.name!r} does not exist", param=_lora_param(params, exc.name),
                           code="lora_not_found") from None
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from None
        try:
            return await asyncio.wrap_future(future)
        except LoRALoadFailed as exc:
            raise APIError(422, str(exc), param=_lora_param(params, exc.name), code="lora_load_failed") from None

    def close(self) -> None:
        self.loop.stop()
        if self.loop.lora_cache is not None:
            self.loop.lora_cache.close()
