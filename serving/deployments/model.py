"""The model replica: one engine loop batching requests step by step, with its LoRA cache."""

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
from serving.common.logging import get_logger
from serving.common.memory import MemoryReport
from serving.common.metrics import Metrics
from serving.config import DiffusionAppConfig, EngineTuning
from serving.controlnet.client import MeasuredControlNets
from serving.deployments.cfg_worker import ServeCFGWorker
from serving.deployments.controlnet import SendsControlNetCalls, ServeControlNets
from serving.deployments.pinning import pin_replica
from serving.engine import EngineLoop, GenerationEvent, GenerationParams, GenerationResult, LocalBackend, ModelInfo
from serving.engine.shared_core import SharedCore

logger = get_logger("deployments.model")


def model_backend(config: DiffusionAppConfig, controlnets: dict[str, DeploymentHandle],
                  cfg_worker: DeploymentHandle | None, metrics: Metrics, core: SharedCore | None = None,
                  ) -> tuple[ServeControlNets | None, LocalBackend]:
    """The engine of ``config``'s model in this replica, calling its ControlNet services and CFG worker over
    Serve (on ``core``: taking turns with the replica's other models); with the ControlNet client it calls."""
    timeout_s = config.engine.remote_timeout_s
    controlnet_client = ServeControlNets(controlnets, timeout_s, metrics) if controlnets else None
    client = MeasuredControlNets(controlnet_client, metrics) if controlnet_client is not None else None
    worker = ServeCFGWorker(cfg_worker, timeout_s, metrics) if cfg_worker is not None else None
    return controlnet_client, LocalBackend.from_config(config, controlnets=client, cfg_worker=worker,
                                                       metrics=metrics, core=core)


def tune(loop: EngineLoop, user_config: dict[str, Any]) -> None:
    """Applies an ``EngineTuning`` (Serve ``user_config``) to ``loop`` without a restart."""
    loop.config = EngineTuning.model_validate(user_config).apply(loop.config)
    logger.info("engine of %r now %s", loop.engine.info.name,
                loop.config.model_dump(include=set(EngineTuning.model_fields)))


@serve.deployment(ray_actor_options={"num_cpus": 1, "runtime_env": REPLICA_RUNTIME_ENV}, max_ongoing_requests=32,
                  max_queued_requests=8, backpressure_config=OVERLOADED)
class DiffusionModel(MemoryReport, SendsControlNetCalls):
    """One diffusion engine and its LoRA cache; the engine refuses requests that would wait too long for their
    first step (``engine.admission_wait_fraction``), Serve's queue bounds the rest."""

    @checks_allocator
    @enforces_replica_share
    def __init__(self, config: DiffusionAppConfig, controlnets: dict[str, DeploymentHandle],
                 cfg_worker: DeploymentHandle | None = None) -> None:
        pin_replica(config.model_cores(), "DiffusionModel")
        self._controlnet_client, self._backend = model_backend(config, controlnets, cfg_worker, Metrics.for_replica())

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies an ``EngineTuning`` (Serve ``user_config``, e.g. ``{max_batch_rows: 8}``) without a restart."""
        tune(self._backend.loop, user_config)

    async def model_info(self) -> ModelInfo:
        return await self._backend.model_info()

    async def list_loras(self) -> list[str]:
        return await self._backend.list_loras()

    async def list_controlnets(self) -> list[str]:
        return await self._backend.list_controlnets()

    async def engine_busy(self) -> tuple[int, float]:
        """This replica's pid and the seconds its engine loop has spent computing denoising steps since it started
        (waits for ControlNet services and the CFG worker left out)."""
        return os.getpid(), self._backend.loop.busy_s

    async def generate(self, params: GenerationParams) -> GenerationResult | APIError:
        """The result, or the ``APIError`` to answer, as a value: Serve logs an exception a replica method raises
        as a failed request with its traceback, which a client's bad request or an overload refusal is not."""
        return await answer(self._backend, params)

    async def generate_stream(self, params: GenerationParams) -> AsyncIterator[GenerationEvent | APIError]:
        """Serve streaming (``handle.options(stream=True)``): the previews, then the result; a refusal or failure as
        an ``APIError`` event, the last, as ``generate`` returns it. Serve cancelling the call (the client went
        away) cancels the request."""
        async with aclosing(answer_stream(self._backend, params)) as events:
            async for event in events:
                yield event

    def __del__(self) -> None:  # Serve calls this on graceful replica shutdown
        backend = getattr(self, "_backend", None)
        if backend is not None:
            backend.close()


async def answer(backend: LocalBackend, params: GenerationParams) -> GenerationResult | APIError:
    """``backend``'s result, or the ``APIError`` to answer, as a value (a replica method's answer)."""
    try:
        return await backend.generate(params)
    except APIError as error:
        return error


async def answer_stream(backend: LocalBackend, params: GenerationParams,
                        ) -> AsyncIterator[GenerationEvent | APIError]:
    """``backend``'s previews, then its result; a refusal or failure as the last event, an ``APIError``."""
    try:
        async with aclosing(backend.generate_stream(params)) as events:
            async for event in events:
                yield event
    except APIError as error:
        yield error
