"""``LocalBackend``: the engine interface over an in-process engine loop (a Serve replica or a test).

Engine, LoRA and ControlNet errors are ``APIError``s already; here one naming a request item gets its position.
Cancelling a call (or closing a stream early) cancels the request in the engine loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from serving.common.errors import RequestItemError
from serving.common.metrics import NO_METRICS, Metrics
from serving.config import DiffusionAppConfig
from serving.controlnet.client import ControlNetClient
from serving.controlnet.models import controlnet_family
from serving.engine.cfg import CFGWorker, WorkerPatience
from serving.engine.diffusion_engine import DiffusionEngine
from serving.engine.loop import EngineLoop, StepCallback
from serving.engine.shared_core import SharedCore
from serving.engine.types import (
    GenerationEvent,
    GenerationParams,
    GenerationResult,
    ImageGenerationBackend,
    ModelInfo,
    PartialImage,
)
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
                    metrics: Metrics = NO_METRICS, core: SharedCore | None = None) -> LocalBackend:
        """The model ``config`` names, served by an engine loop (on ``core``: taking turns with other models')."""
        worker = config.engine.cfg_worker
        patience = WorkerPatience(worker.patience, worker.min_wait_s, worker.retry_after_s, worker.max_retry_after_s)
        engine = DiffusionEngine.from_config(config.model, config.lora, controlnets, cfg_worker, patience, metrics)
        check_controlnet_families(config, engine.info.family)
        return cls.for_engine(engine, config, on_step=on_step, metrics=metrics, core=core)

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
                   on_step: StepCallback | None = None, metrics: Metrics = NO_METRICS,
                   core: SharedCore | None = None) -> LocalBackend:
        """A backend over ``engine``; its loop, LoRA cache and requests record into ``metrics``."""
        cache = cls.lora_cache_for(engine, config, metrics)
        return cls(EngineLoop(engine, config.engine, cache, on_step=on_step, metrics=metrics,
                              preview=config.engine.preview_decoder, core=core), metrics)

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
        with self._metrics.request("diffusion_generation"), _located_errors(params):
            return await asyncio.wrap_future(self.loop.submit(params))

    async def generate_stream(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """The loop's preview callbacks and its future's completion come from the stage thread in order and are
        bridged onto this event loop in that order; leaving before the result (closed, cancelled) cancels the
        request. The request's latency is recorded when its result is in hand, before it is yielded."""
        events: asyncio.Queue[PartialImage | Future[GenerationResult]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(event: PartialImage | Future[GenerationResult]) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        with self._metrics.request("diffusion_generation"), _located_errors(params):
            future = self.loop.submit(params, on_preview=put)
            future.add_done_callback(put)
            try:
                while not isinstance(event := await events.get(), Future):
                    yield event
                result = event.result()
            finally:
                future.cancel()  # nothing when it finished
        yield result

    def close(self) -> None:
        self.loop.stop()
        if self.loop.lora_cache is not None:
            self.loop.lora_cache.close()


@contextmanager
def _located_errors(params: GenerationParams) -> Iterator[None]:
    """Raises a ``RequestItemError`` as the ``APIError`` at where this request names the item (``loras[2].name``)."""
    try:
        yield
    except RequestItemError as error:
        raise error.located([item.name for item in getattr(params, error.field)]) from None


def check_controlnet_families(config: DiffusionAppConfig, family: str) -> None:
    """ValueError naming the first configured ControlNet that conditions another family than the model's."""
    for index, controlnet in enumerate(config.controlnets):
        found = controlnet_family(controlnet.preset, controlnet.path)
        if found != family:
            source = f"preset {controlnet.preset}" if controlnet.preset is not None else str(controlnet.path)
            raise ValueError(f"controlnets[{index}] ({controlnet.name!r}, {source}) is a ControlNet for the {found} "
                             f"family, and model {config.model.name!r} is {family}")
