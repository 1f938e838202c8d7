"""Parallel CFG on Serve: the ``CFGWorker`` deployment and the engine's client of it.

The worker merges the step calls of every model replica into one denoiser forward per latent shape (``@serve.batch``).
A request's text embeddings reach it once (object-store references, ``transport``), not every step. Its LoRAs are
prefetched when the request reaches a model replica; rows whose LoRAs the worker has not loaded yet are answered
as skipped, and the model replica computes them itself that step. Once a request is denoised, the worker decodes
the lower band of its image (``serving.engine.band_decode``) in one streaming call that sends back the worker's
syncs; the replica's syncs reach that call through a queue actor of the replica (a Serve call takes no input
stream, and a second call might reach another worker replica).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util.queue import Queue

from serving.common.allocator import REPLICA_RUNTIME_ENV, checks_allocator
from serving.common.cpu_share import enforces_replica_share
from serving.common.device import placement
from serving.common.logging import get_logger
from serving.common.metrics import NO_METRICS, Metrics
from serving.common.tensors import from_numpy, to_numpy
from serving.config import DiffusionAppConfig
from serving.controlnet.client import MeasuredControlNets
from serving.controlnet.runner import gather_context
from serving.deployments.batching import forward_by_shape
from serving.deployments.controlnet import SendsControlNetCalls, ServeControlNets
from serving.deployments.pinning import pin_replica
from serving.deployments.transport import ResolvedTensors, SharedTensors
from serving.deployments.wire import PendingReply, WireNoise, WireRows
from serving.engine import DiffusionEngine, LocalBackend
from serving.engine.band_decode import BOTTOM, BandGenerator, BandPeer, BandStep, BandSync, decode_band, next_step
from serving.engine.cfg import CFGWorker, WorkerNoise
from serving.engine.rows import RowBatch
from serving.lora.cache import LoRACache
from serving.lora.weights import LoRAWeights

logger = get_logger("deployments.cfg_worker")


def _queue_actor() -> Queue:
    return Queue(actor_options={"num_cpus": 0})


class ServeCFGWorker(CFGWorker):
    """The engine's CFG worker as the ``CFGWorker`` deployment; the bytes each step's call moves are recorded
    (``Metrics.remote_bytes``, path ``cfg``)."""

    def __init__(self, handle: DeploymentHandle, timeout_s: float, metrics: Metrics = NO_METRICS, *,
                 put: Callable[[np.ndarray], Any] = ray.put, band_queue: Callable[[], Any] = _queue_actor) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._shared = SharedTensors(put, sent=lambda nbytes: metrics.remote_bytes("cfg", "sent", nbytes))
        self._new_band_queue = band_queue
        self._band_queue: Any = None  # the replica's queue to the worker's band decodes, made at the first one

    def submit(self, batch: RowBatch) -> PendingReply[WorkerNoise]:
        wire = WireRows(
            sample=to_numpy(batch.sample),
            timestep=to_numpy(batch.timestep),
            context=self._shared.rows(batch.context_rows),
            context_length=batch.context.shape[1],
            loras=[tuple((weights.name, scale) for weights, scale in row) for row in batch.loras],
            controls=[tuple((name, self._shared.ref(image), scale) for name, image, scale in row)
                      for row in batch.controls],
            added={name: to_numpy(value) for name, value in batch.added.items()},
        )
        self._metrics.remote_bytes("cfg", "sent", wire.nbytes)
        return PendingReply(self._handle.predict.remote(wire), self._timeout_s, self._noise)

    def prefetch(self, names: Sequence[str]) -> None:
        self._handle.prefetch.remote(list(names))  # not awaited: the worker loads them while the request starts

    def band_peer(self, latents: torch.Tensor) -> BandPeer:
        if self._band_queue is None:
            self._band_queue = self._new_band_queue()
        return ServeBandPeer(self._handle, self._band_queue, latents, self._timeout_s, self._metrics)

    def _noise(self, wire: WireNoise) -> WorkerNoise:
        self._metrics.remote_bytes("cfg", "received", wire.nbytes)
        return WorkerNoise(from_numpy(wire.noise), wire.skipped)


class ServeBandPeer(BandPeer):
    """The bottom band of one decode on a CFG worker replica: its steps come back on one streaming call, the top
    band's syncs go to it through ``queue`` tagged with this decode's session; each waits at most ``timeout_s``."""

    def __init__(self, handle: DeploymentHandle, queue: Any, latents: torch.Tensor, timeout_s: float,
                 metrics: Metrics = NO_METRICS) -> None:
        self._session, self._queue, self._timeout_s, self._metrics = uuid.uuid4().hex, queue, timeout_s, metrics
        array = to_numpy(latents)
        metrics.remote_bytes("cfg", "sent", array.nbytes)
        self._stream = handle.options(stream=True).decode_band.remote(self._session, array, queue)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="band-peer")  # a bounded wait

    def send(self, sync: BandSync) -> None:
        wire = band_step_to_wire(sync)
        self._metrics.remote_bytes("cfg", "sent", _wire_bytes(wire))
        self._queue.put((self._session, wire), timeout=self._timeout_s)

    def receive(self) -> BandStep:
        wire = self._reader.submit(next, self._stream).result(timeout=self._timeout_s)
        self._metrics.remote_bytes("cfg", "received", _wire_bytes(wire))
        return band_step_from_wire(wire)

    def close(self) -> None:
        self._stream.cancel()
        self._reader.shutdown(wait=False)


def band_step_to_wire(step: BandStep) -> np.ndarray | tuple:
    """A band step as numpy: its rows, or (edge, count, mean, m2) of a sync."""
    if isinstance(step, torch.Tensor):
        return to_numpy(step)
    return (to_numpy(step.edge), step.count, None if step.mean is None else to_numpy(step.mean),
            None if step.m2 is None else to_numpy(step.m2))


def band_step_from_wire(wire: np.ndarray | tuple) -> BandStep:
    if isinstance(wire, np.ndarray):
        return from_numpy(wire)
    edge, count, mean, m2 = wire
    return BandSync(from_numpy(edge), count, None if mean is None else from_numpy(mean),
                    None if m2 is None else from_numpy(m2))


def _wire_bytes(wire: np.ndarray | tuple) -> int:
    return sum(part.nbytes for part in (wire if isinstance(wire, tuple) else (wire,)) if isinstance(part, np.ndarray))


class CFGWorkerCore:
    """The CFG worker's work without Serve: the calls of one latent shape decoded (references resolved once per
    replica) and run as one forward, over their rows whose LoRAs are loaded here; the other rows are skipped, their
    loads started if they were not yet. A LoRA load never blocks a forward."""

    def __init__(self, engine: DiffusionEngine, loras: LoRACache | None, tensors: ResolvedTensors) -> None:
        self.engine = engine
        self._loras = loras
        self._tensors = tensors

    def prefetch(self, names: Sequence[str]) -> None:
        """Starts loading ``names`` in the background (a request using them reached a model replica)."""
        for name in names:
            self._load(name)

    def forward(self, calls: list[WireRows]) -> list[WireNoise]:
        loads = {name: self._load(name) for call in calls for row in call.loras for name, _ in row}
        kept = [[index for index, row in enumerate(call.loras) if all(_loaded(loads[name]) for name, _ in row)]
                for call in calls]
        if any(kept):
            noise = to_numpy(self.engine.predict_noise(self._decode(calls, kept, loads)))
            parts = np.split(noise, np.cumsum([len(rows) for rows in kept])[:-1])
        else:
            parts = [call.sample[:0] for call in calls]
        return [WireNoise(part, sorted(set(range(call.rows)) - set(rows)))
                for call, rows, part in zip(calls, kept, parts, strict=True)]

    def _decode(self, calls: list[WireRows], kept: list[list[int]],
                loads: dict[str, Future[LoRAWeights]]) -> RowBatch:
        """The ``kept`` rows of ``calls`` as one batch on the engine's device."""
        device = self.engine.device
        chosen = list(zip(calls, kept, strict=True))
        picked = [(call, index) for call, rows in chosen for index in rows]
        context_rows = self._tensors.rows([call.context[index] for call, index in picked])
        return RowBatch(
            sample=from_numpy(np.concatenate([call.sample[rows] for call, rows in chosen])).to(device),
            timestep=from_numpy(np.concatenate([call.timestep[rows] for call, rows in chosen])).to(device),
            context=gather_context(context_rows).to(device),
            context_rows=context_rows,
            loras=[tuple((self.engine.lora_on_device(loads[name].result()), scale) for name, scale in call.loras[i])
                   for call, i in picked],
            controls=[tuple((name, self._tensors.get(ref), scale) for name, ref, scale in call.controls[i])
                      for call, i in picked],
            added={name: from_numpy(np.concatenate([call.added[name][rows] for call, rows in chosen])).to(device)
                   for name in calls[0].added},
        )

    async def band_steps(self, session: str, latents: np.ndarray, queue: Any,
                         timeout_s: float) -> AsyncIterator[np.ndarray | tuple]:
        """The bottom band of the VAE decode of ``latents`` on this worker's device, as wire steps: each after the
        replica's previous sync arrived on ``queue`` (``get_async``; items of other sessions, left by an aborted
        decode, are dropped), the band computed on a worker thread."""
        band: BandGenerator = decode_band(self.engine.vae, from_numpy(latents).to(self.engine.device), BOTTOM)
        step: BandStep = await asyncio.to_thread(next, band)
        while True:
            yield band_step_to_wire(step)
            if isinstance(step, torch.Tensor):
                return
            while (item := await queue.get_async(timeout=timeout_s))[0] != session:
                pass
            sync = band_step_from_wire(item[1])
            assert isinstance(sync, BandSync)
            step = await asyncio.to_thread(next_step, band, sync.to(self.engine.device))

    def _load(self, name: str) -> Future[LoRAWeights]:
        if self._loras is None:
            raise RuntimeError("CFG worker has no LoRA directory configured")
        return self._loras.get(name)


def _loaded(load: Future[LoRAWeights]) -> bool:
    return load.done() and load.exception() is None


@serve.deployment(name="CFGWorker", ray_actor_options={"num_cpus": 1, "runtime_env": REPLICA_RUNTIME_ENV},
                  max_ongoing_requests=64)
class CFGWorkerDeployment(SendsControlNetCalls):
    """A second copy of the model, on its own device, predicting the unconditional rows of every model replica's
    steps (``CFGWorkerCore``), their calls batched as ``engine.cfg_worker`` says."""

    @checks_allocator
    @enforces_replica_share
    def __init__(self, config: DiffusionAppConfig, controlnets: dict[str, DeploymentHandle]) -> None:
        pin_replica(config.device_map.cfg_worker if config.device_map else [], "CFGWorker")
        metrics = Metrics.for_replica()
        self._controlnet_client = (ServeControlNets(controlnets, config.engine.remote_timeout_s, metrics)
                                   if controlnets else None)
        client = MeasuredControlNets(self._controlnet_client, metrics) if self._controlnet_client is not None else None
        engine = DiffusionEngine.from_config(config.model, config.lora, client)
        self._core = CFGWorkerCore(engine, LocalBackend.lora_cache_for(engine, config, metrics), ResolvedTensors())
        self._timeout_s = config.engine.remote_timeout_s
        self._batched.set_max_batch_size(config.engine.cfg_worker.max_batch_size)
        self._batched.set_batch_wait_timeout_s(config.engine.cfg_worker.batch_wait_timeout_s)
        logger.info("CFG worker up on %s", placement())

    def prefetch(self, names: list[str]) -> None:
        self._core.prefetch(names)

    async def predict(self, wire: WireRows) -> WireNoise:
        return await self._batched(wire)

    async def decode_band(self, session: str, latents: np.ndarray, queue: Queue) -> AsyncIterator[np.ndarray | tuple]:
        """Streams the bottom band of one decode (``ServeBandPeer`` is the caller)."""
        async for wire in self._core.band_steps(session, latents, queue, self._timeout_s):
            yield wire

    @serve.batch
    async def _batched(self, calls: list[WireRows]) -> list[WireNoise]:
        # No lock: serve.batch runs one batch at a time (max_concurrent_batches 1), and the LoRA hooks, which hold
        # per-forward state, need exactly that.
        return await forward_by_shape(calls, lambda call: (call.sample.shape[1:], call.context_length),
                                      self._core.forward)
