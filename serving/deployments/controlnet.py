"""ControlNet-as-a-Service: one Serve deployment per ControlNet, shared by every base-model replica.

Tensors cross processes as numpy arrays; a request's conditioning image and text embeddings are put in the
object store once and referenced by every step's call; each service replica keeps recently used ones resolved.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.common.allocator import REPLICA_RUNTIME_ENV, checks_allocator
from serving.common.cpu_share import enforces_replica_share
from serving.common.device import DTYPES, placement, resolve_device, set_torch_threads
from serving.common.logging import get_logger
from serving.common.memory import MemoryReport
from serving.common.metrics import NO_METRICS, Metrics
from serving.common.tensors import from_numpy, to_numpy
from serving.config import ControlNetConfig
from serving.controlnet.client import ControlNetClient, ControlNetNotFound
from serving.controlnet.models import build_controlnet_preset, load_controlnet
from serving.controlnet.runner import (
    ControlNetCall,
    ControlNetResiduals,
    ControlNetRunner,
    gather_context,
    merge_calls,
    split_residuals,
)
from serving.deployments.batching import forward_by_shape
from serving.deployments.pinning import pin_replica
from serving.deployments.transport import ResolvedTensors, SharedTensors
from serving.deployments.wire import PendingReply, WireCall, WireResiduals

logger = get_logger("deployments.controlnet")


class ServeControlNets(ControlNetClient):
    """The engine's ControlNets as ControlNet deployments (one handle per ControlNet); the bytes each step's calls
    move are recorded (``Metrics.remote_bytes``, path ``controlnet``), the calls sent counted per ControlNet
    (``calls_sent``)."""

    def __init__(self, handles: dict[str, DeploymentHandle], timeout_s: float, metrics: Metrics = NO_METRICS, *,
                 put: Callable[[np.ndarray], Any] = ray.put) -> None:
        self._handles = handles
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._shared = SharedTensors(put, sent=lambda nbytes: metrics.remote_bytes("controlnet", "sent", nbytes))
        self.calls_sent: Counter[str] = Counter()

    def names(self) -> list[str]:
        return sorted(self._handles)

    def submit(self, name: str, call: ControlNetCall) -> PendingReply[ControlNetResiduals]:
        if name not in self._handles:
            raise ControlNetNotFound(name)
        wire = WireCall(
            sample=to_numpy(call.sample),
            timestep=to_numpy(call.timestep),
            context=self._shared.rows(call.context_rows),
            context_length=call.encoder_hidden_states.shape[1],
            scales=to_numpy(call.scales),
            images=[(self._shared.ref(image), rows) for image, rows in call.images],
            added={name: to_numpy(value) for name, value in call.added.items()},
            latent_shift=call.latent_shift,
        )
        self._metrics.remote_bytes("controlnet", "sent", wire.nbytes)
        self.calls_sent[name] += 1
        return PendingReply(self._handles[name].residuals.remote(wire), self._timeout_s, self._residuals)

    def _residuals(self, wire: WireResiduals) -> ControlNetResiduals:
        self._metrics.remote_bytes("controlnet", "received", wire.nbytes)
        return ControlNetResiduals([from_numpy(block) for block in wire.down],
                                   from_numpy(wire.mid) if wire.mid is not None else None,
                                   [from_numpy(block) for block in wire.single])


class SendsControlNetCalls:
    """Deployment mixin: ``controlnet_calls()`` answers the replica's pid and the calls its ``ServeControlNets``
    (``self._controlnet_client``, ``None`` without ControlNets) sent so far, per ControlNet."""

    _controlnet_client: ServeControlNets | None

    async def controlnet_calls(self) -> tuple[int, dict[str, int]]:
        client = self._controlnet_client
        return os.getpid(), dict(client.calls_sent) if client is not None else {}


class ControlNetCore:
    """A ControlNet service's work without Serve: the calls of one latent shape (and latent shift) decoded
    (references resolved once per replica), run as one forward, and each call's residuals encoded."""

    def __init__(self, runner: ControlNetRunner, tensors: ResolvedTensors) -> None:
        self._runner = runner
        self._tensors = tensors

    def forward(self, calls: list[WireCall]) -> list[WireResiduals]:
        decoded = [self._decode(call) for call in calls]
        residuals = self._runner.run(merge_calls(decoded))
        return [WireResiduals([to_numpy(block) for block in part.down],
                              to_numpy(part.mid) if part.mid is not None else None,
                              [to_numpy(block) for block in part.single])
                for part in split_residuals(residuals, [call.rows for call in decoded])]

    def _decode(self, call: WireCall) -> ControlNetCall:
        context_rows = self._tensors.rows(call.context)
        images = [(self._tensors.get(ref), rows) for ref, rows in call.images]
        return ControlNetCall(from_numpy(call.sample), from_numpy(call.timestep), gather_context(context_rows),
                              context_rows, from_numpy(call.scales), images,
                              {name: from_numpy(value) for name, value in call.added.items()}, call.latent_shift)


@serve.deployment(ray_actor_options={"num_cpus": 0.2, "runtime_env": REPLICA_RUNTIME_ENV}, max_ongoing_requests=64)
class ControlNetService(MemoryReport):
    """One ControlNet; calls from every base replica and step are batched into shared forwards. ``cores``: its
    replicas' ``DeviceMap.controlnets`` entries (none: not pinned). ``calls_served()``: the calls it answered."""

    @checks_allocator
    @enforces_replica_share
    def __init__(self, config: ControlNetConfig, cores: Sequence[Sequence[int]] = ()) -> None:
        pin_replica(cores, f"ControlNet {config.name!r}")
        device = resolve_device(config.device)
        set_torch_threads(config.torch_threads)
        model = (build_controlnet_preset(config.preset, config.seed, weights=config.weights) if config.preset
                 else load_controlnet(config.path))
        self._core = ControlNetCore(ControlNetRunner(model, device, DTYPES[config.dtype]), ResolvedTensors())
        self._batched.set_max_batch_size(config.max_batch_size)
        self._batched.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        self._served = 0
        logger.info("ControlNet %r serving (%s, device=%s) on %s", config.name,
                    f"preset={config.preset}" if config.preset else f"path={config.path}", device, placement())

    async def residuals(self, call: WireCall) -> WireResiduals:
        residuals = await self._batched(call)
        self._served += 1
        return residuals

    async def calls_served(self) -> int:
        return self._served

    @serve.batch
    async def _batched(self, calls: list[WireCall]) -> list[WireResiduals]:
        return await forward_by_shape(calls,
                                      lambda call: (call.sample.shape[1:], call.context_length, call.latent_shift),
                                      self._core.forward)
