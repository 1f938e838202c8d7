"""ControlNet-as-a-Service: one Serve deployment per ControlNet, shared by every base-model replica.

Tensors cross processes as numpy arrays; a request's conditioning image is put in the object store
once and referenced by every step's call; each service replica keeps recently used images resolved.
"""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.common.device import DTYPES, placement, resolve_device, set_torch_threads
from serving.common.logging import get_logger
from serving.common.memory import MemoryReport
from serving.config import ControlNetConfig
from serving.controlnet.client import ControlNetClient, ControlNetNotFound
from serving.controlnet.models import build_controlnet_preset, load_controlnet
from serving.controlnet.runner import (
    ControlNetCall,
    ControlNetResiduals,
    ControlNetRunner,
    merge_calls,
    split_residuals,
)
from serving.deployments.transport import ResolvedTensors, SharedTensors, from_numpy, to_numpy
from serving.deployments.wire import PendingReply, WireCall, WireResiduals

logger = get_logger("deployments.controlnet")


def _residuals(wire: WireResiduals) -> ControlNetResiduals:
    return ControlNetResiduals([from_numpy(block) for block in wire.down], from_numpy(wire.mid))


class ServeControlNets(ControlNetClient):
    """The engine's ControlNets as ControlNet deployments (one handle per ControlNet)."""

    def __init__(self, handles: dict[str, DeploymentHandle], timeout_s: float) -> None:
        self._handles = handles
        self._timeout_s = timeout_s
        self._images = SharedTensors()

    def names(self) -> list[str]:
        return sorted(self._handles)

    def submit(self, name: str, call: ControlNetCall) -> PendingReply[ControlNetResiduals]:
        if name not in self._handles:
            raise ControlNetNotFound(name)
        wire = WireCall(
            sample=to_numpy(call.sample),
            timestep=to_numpy(call.timestep),
            encoder_hidden_states=to_numpy(call.encoder_hidden_states),
            scales=to_numpy(call.scales),
            images=[(self._images.ref(image), rows) for image, rows in call.images],
        )
        return PendingReply(self._handles[name].residuals.remote(wire), self._timeout_s, _residuals)


@serve.deployment(ray_actor_options={"num_cpus": 0.2}, max_ongoing_requests=64)
class ControlNetService(MemoryReport):
    """One ControlNet; calls from every base replica and step are batched into shared forwards."""

    def __init__(self, config: ControlNetConfig) -> None:
        device = resolve_device(config.device)
        set_torch_threads(config.torch_threads)
        model = (build_controlnet_preset(config.preset, config.seed, weights=config.weights) if config.preset
                 else load_controlnet(config.path))
        self._runner = ControlNetRunner(model, device, DTYPES[config.dtype])
        self._images = ResolvedTensors()
        self._batched.set_max_batch_size(config.max_batch_size)
        self._batched.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        logger.info("ControlNet %r serving (%s, device=%s) on %s", config.name,
                    f"preset={config.preset}" if config.preset else f"path={config.path}", device, placement())

    async def residuals(self, call: WireCall) -> WireResiduals:
        return await self._batched(call)

    @serve.batch
    async def _batched(self, calls: list[WireCall]) -> list[WireResiduals]:
        decoded = await asyncio.to_thread(lambda: [self._decode(call) for call in calls])
        results: list[WireResiduals | None] = [None] * len(calls)
        by_shape: dict[tuple, list[int]] = {}
        for index, call in enumerate(decoded):  # only calls with the same latent size share a forward
            by_shape.setdefault(tuple(call.sample.shape[1:]), []).append(index)
        for indices in by_shape.values():
            group = [decoded[i] for i in indices]
            residuals = await asyncio.to_thread(self._runner.run, merge_calls(group))
            for index, part in zip(indices, split_residuals(residuals, [c.rows for c in group]), strict=True):
                results[index] = WireResiduals([to_numpy(block) for block in part.down], to_numpy(part.mid))
        return results

    def _decode(self, call: WireCall) -> ControlNetCall:
        images = [(self._images.get(ref), rows) for ref, rows in call.images]
        return ControlNetCall(from_numpy(call.sample), from_numpy(call.timestep),
                              from_numpy(call.encoder_hidden_states), from_numpy(call.scales), images)
