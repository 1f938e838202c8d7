"""Parallel CFG on Serve: the ``CFGWorker`` deployment and the engine's client of it."""

from __future__ import annotations

import asyncio

import numpy as np
from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.common.device import placement
from serving.common.logging import get_logger
from serving.common.metrics import Metrics
from serving.config import DiffusionAppConfig
from serving.controlnet.client import MeasuredControlNets
from serving.deployments.controlnet import ServeControlNets
from serving.deployments.transport import ResolvedTensors, SharedTensors, from_numpy, to_numpy
from serving.deployments.wire import PendingReply, WireRows
from serving.engine import DiffusionEngine, LocalBackend
from serving.engine.cfg import CFGWorker
from serving.engine.rows import RowBatch

logger = get_logger("deployments.cfg_worker")


class ServeCFGWorker(CFGWorker):
    """The engine's CFG worker as the ``CFGWorker`` deployment."""

    def __init__(self, handle: DeploymentHandle, timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._images = SharedTensors()

    def submit(self, batch: RowBatch) -> PendingReply:
        wire = WireRows(
            sample=to_numpy(batch.sample),
            timestep=to_numpy(batch.timestep),
            context=to_numpy(batch.context),
            loras=[tuple((weights.name, scale) for weights, scale in row) for row in batch.loras],
            controls=[tuple((name, self._images.ref(image), scale) for name, image, scale in row)
                      for row in batch.controls],
        )
        return PendingReply(self._handle.predict.remote(wire), self._timeout_s, from_numpy)


@serve.deployment(name="CFGWorker", ray_actor_options={"num_cpus": 1})
class CFGWorkerDeployment:
    """A second copy of the model, on its own device, predicting the unconditional rows of each step."""

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
