"""The model group replica: every model of an app in one replica, their engine loops sharing its cores."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.common.allocator import REPLICA_RUNTIME_ENV, checks_allocator
from serving.common.backpressure import OVERLOADED
from serving.common.cpu_share import enforces_replica_share
from serving.common.errors import APIError
from serving.common.memory import MemoryReport
from serving.common.metrics import Metrics
from serving.config import ImagesAppConfig
from serving.deployments.model import answer, answer_stream, model_backend, tune
from serving.deployments.pinning import pin_replica
from serving.engine import GenerationEvent, GenerationParams, GenerationResult, LocalBackend, ModelInfo
from serving.engine.shared_core import SharedCore


@serve.deployment(ray_actor_options={"num_cpus": 1, "runtime_env": REPLICA_RUNTIME_ENV}, max_ongoing_requests=64,
                  max_queued_requests=16, backpressure_config=OVERLOADED)
class DiffusionModelGroup(MemoryReport):
    """One engine loop per model of ``config`` (``shared_replicas``), taking turns at this replica's cores
    (``SharedCore``); every call names its model. Each model calls its own ControlNet services and CFG worker."""

    @checks_allocator
    @enforces_replica_share
    def __init__(self, config: ImagesAppConfig, controlnets: dict[str, dict[str, DeploymentHandle]],
                 cfg_workers: dict[str, DeploymentHandle | None]) -> None:
        pin_replica(config.group_cores(), "DiffusionModelGroup")
        metrics, core = Metrics.for_replica(), SharedCore()
        self._backends: dict[str, LocalBackend] = {}
        for entry in config.models:
            name = entry.model.name
            _, self._backends[name] = model_backend(entry, controlnets.get(name, {}), cfg_workers.get(name), metrics,
                                                    core)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies an ``EngineTuning`` (Serve ``user_config``) to every model's engine without a restart."""
        for backend in self._backends.values():
            tune(backend.loop, user_config)

    async def model_info(self, model: str) -> ModelInfo:
        return await self._backends[model].model_info()

    async def list_loras(self, model: str) -> list[str]:
        return await self._backends[model].list_loras()

    async def list_controlnets(self, model: str) -> list[str]:
        return await self._backends[model].list_controlnets()

    async def engine_busy(self) -> tuple[int, float]:
        """As ``DiffusionModel.engine_busy``: the pid and the seconds the models' engine loops have spent computing
        denoising steps since the replica started."""
        return os.getpid(), sum(backend.loop.busy_s for backend in self._backends.values())

    async def generate(self, model: str, params: GenerationParams) -> GenerationResult | APIError:
        """As ``DiffusionModel.generate``, on ``model``."""
        return await answer(self._backends[model], params)

    async def generate_stream(self, model: str, params: GenerationParams,
                              ) -> AsyncIterator[GenerationEvent | APIError]:
        """As ``DiffusionModel.generate_stream``, on ``model``."""
        async with aclosing(answer_stream(self._backends[model], params)) as events:
            async for event in events:
                yield event

    def __del__(self) -> None:  # Serve calls this on graceful replica shutdown
        for backend in getattr(self, "_backends", {}).values():
            backend.close()
