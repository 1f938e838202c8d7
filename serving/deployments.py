"""Ray Serve deployments of the diffusion application.

``ImagesIngress`` (HTTP, FastAPI) --handle--> ``DiffusionModel`` (one engine loop per replica)
--handles--> one ``ControlNetService`` deployment per ControlNet, shared by every model replica,
and, with ``engine.cfg_parallel``, a ``CFGWorker`` computing the unconditional CFG rows.
All scale independently.

Overload: each ``DiffusionModel`` replica holds at most ``max_ongoing_requests`` requests and its engine refuses
at once those that would wait too long for their first step (``engine.admission_wait_fraction``); the ingress
queues at most ``max_queued_requests`` more for the model. Beyond that a request is refused at once with 503
and ``Retry-After`` in the API's error shape. The ingress itself takes
``max_ongoing_requests`` requests (mostly waiting on the model) and Serve's proxy queues ``max_queued_requests``
more before answering 503 itself. Serve configs may change all four and ``backpressure_config``.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from fastapi import FastAPI
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from serving._private.transport import ResolvedTensors, SharedTensors, from_numpy, to_numpy
from serving.api import create_images_api
from serving.common.constants import API_KEY
from serving.common.device import placement
from serving.common.http import APIError
from serving.common.logging import get_logger
from serving.common.memory import ProcessMemory, process_memory
from serving.common.metrics import Metrics
from serving.config import DiffusionAppConfig, EngineTuning
from serving.controlnet.client import MeasuredControlNets
from serving.controlnet.service import ServeControlNets
from serving.engine import DiffusionEngine, GenerationParams, GenerationResult, LocalBackend, ModelInfo
from serving.engine.rows import RowBatch

logger = get_logger("deployments")


@dataclass
class WireRows:
    """``RowBatch`` as it travels to the CFG worker: arrays, LoRA names, image references."""

    sample: np.ndarray
    timestep: np.ndarray
    context: np.ndarray
    loras: list[tuple[tuple[str, float], ...]]
    controls: list[tuple[tuple[str, ray.ObjectRef, float], ...]]


class _PendingNoise:
    def __init__(self, response: DeploymentResponse, timeout_s: float) -> None:
        self._response = response
        self._timeout_s = timeout_s

    def result(self) -> torch.Tensor:
        return from_numpy(self._response.result(timeout_s=self._timeout_s))


class ServeCFGWorker:
    """The engine's ``CFGWorker`` over the ``CFGWorker`` deployment."""

    def __init__(self, handle: DeploymentHandle, timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._images = SharedTensors()

    def submit(self, batch: RowBatch) -> _PendingNoise:
        wire = WireRows(
            sample=to_numpy(batch.sample),
            timestep=to_numpy(batch.timestep),
            context=to_numpy(batch.context),
            loras=[tuple((weights.name, scale) for weights, scale in row) for row in batch.loras],
            controls=[tuple((name, self._images.ref(image), scale) for name, image, scale in row)
                      for row in batch.controls],
        )
        return _PendingNoise(self._handle.predict.remote(wire), self._timeout_s)


@serve.deployment(name="CFGWorker", ray_actor_options={"num_cpus": 1})
class CFGWorkerDeployment:
    """Parallel CFG: a second copy of the model, on its own device, predicting unconditional rows."""

    def __init__(self, config: DiffusionAppConfig, controlnets: dict[str, DeploymentHandle]) -> None:
        metrics = Metrics.for_replica()
        client = (MeasuredControlNets(ServeControlNets(controlnets, config.engine.remote_timeout_s), metrics)
                  if controlnets else None)
        self._engine = DiffusionEngine.from_config(config.model, config.lora, client)
        self._loras = LocalBackend.lora_cache_for(self._engine, config, metrics)
        self._images = ResolvedTensors()
        self._lock = asyncio.Lock()  # one forward at a time: LoRA hooks hold per-forward state
        logger.info("CFG worker up on %s", placement())

    async def predict(self, wire: WireRows) -> np.ndarray:
        async with self._lock:
            return await asyncio.to_thread(self._predict, wire)

    def _predict(self, wire: WireRows) -> np.ndarray:
        batch = RowBatch(
            sample=from_numpy(wire.sample).to(self._engine.device),
            timestep=from_numpy(wire.timestep).to(self._engine.device),
            context=from_numpy(wire.context).to(self._engine.device),
            loras=[tuple((self._lora(name), scale) for name, scale in row) for row in wire.loras],
            controls=[tuple((name, self._images.get(ref), scale) for name, ref, scale in row)
                      for row in wire.controls],
        )
        return to_numpy(self._engine.predict_noise(batch))

    def _lora(self, name: str):
        if self._loras is None:
            raise RuntimeError("CFG worker has no LoRA directory configured")
        return self._engine.lora_on_device(self._loras.get(name).result())


#: Overload answer of both deployments' queues when a Serve config does not set its own ``backpressure_config``.
OVERLOADED = BackpressureConfig(status_code=503, retry_after_s=1)


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32, max_queued_requests=8,
                  backpressure_config=OVERLOADED)
class DiffusionModel:
    """One diffusion engine and its LoRA cache; requests are batched step by step by the engine loop."""

    def __init__(self, config: DiffusionAppConfig, controlnets: dict[str, DeploymentHandle],
                 cfg_worker: DeploymentHandle | None = None) -> None:
        timeout_s = config.engine.remote_timeout_s
        metrics = Metrics.for_replica()
        client = MeasuredControlNets(ServeControlNets(controlnets, timeout_s), metrics) if controlnets else None
        worker = ServeCFGWorker(cfg_worker, timeout_s) if cfg_worker is not None else None
        self._backend = LocalBackend.from_config(config, controlnets=client, cfg_worker=worker, metrics=metrics)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies an ``EngineTuning`` (Serve ``user_config``, e.g. ``{max_batch_rows: 8}``) without a restart."""
        loop = self._backend.loop
        loop.config = EngineTuning.model_validate(user_config).apply(loop.config)
        logger.info("engine now %s", loop.config.model_dump(include=set(EngineTuning.model_fields)))

    async def model_info(self) -> ModelInfo:
        return await self._backend.model_info()

    async def list_loras(self) -> list[str]:
        return await self._backend.list_loras()

    async def list_controlnets(self) -> list[str]:
        return await self._backend.list_controlnets()

    async def generate(self, params: GenerationParams) -> GenerationResult | APIError:
        """The result, or the ``APIError`` to answer, as a value: Serve logs an exception a replica method raises
        as a failed request with its traceback, which a client's bad request or an overload refusal is not."""
        try:
            return await self._backend.generate(params)
        except APIError as error:
            return error

    async def memory_report(self) -> ProcessMemory:
        """RSS of this replica and the weight bytes of the models it holds."""
        return await asyncio.to_thread(process_memory, self)

    def __del__(self) -> None:  # Serve calls this on graceful replica shutdown
        backend = getattr(self, "_backend", None)
        if backend is not None:
            backend.close()


class DeploymentBackend:
    """``ImageGenerationBackend`` over a handle to ``DiffusionModel``.

    Overload (the model's handle queue is full) and a replica dying under a call are 503s with ``Retry-After``;
    a dead replica's call is not retried (a generation may be what killed it).
    """

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
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

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            result = await getattr(self._handle, method).remote(*args)
        except BackPressureError as exc:
            retry_after = str(max(1, math.ceil(exc.retry_after_s or 1)))
            raise APIError(exc.status_code, "the model is at capacity; retry later", code="overloaded",
                           headers={"Retry-After": retry_after}) from None
        except RayActorError as exc:
            logger.warning("model replica failed under a %s call: %s", method, exc)
            raise APIError(503, "the model replica serving this request failed; retry", code="replica_failed",
                           headers={"Retry-After": "1"}) from None
        except RayTaskError as exc:
            if isinstance(exc.cause, APIError):
                raise exc.cause from None
            raise
        if isinstance(result, APIError):  # the model's answer to a request it refused
            raise result
        return result


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=64, max_queued_requests=64,
                  backpressure_config=OVERLOADED)
@serve.ingress()
class ImagesIngress:
    """The OpenAI Images HTTP API; forwards generations to ``DiffusionModel``."""

    def __init__(self, model: DeploymentHandle, config: DiffusionAppConfig) -> None:
        self._backend = DeploymentBackend(model)
        self._config = config
        logger.info("images ingress up on %s", placement())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_images_api(self._backend, self._config, api_key=API_KEY)
