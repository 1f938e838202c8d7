"""The ControlNet wire path in one process (fake handle and object store, no Ray): the engine's calls to a
ControlNet service send a request's conditioning image and text embeddings once, give the in-process images, and
count the bytes they move."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serving.common.metrics import REMOTE_BYTES, InMemorySink, Metrics
from serving.controlnet.client import LocalControlNets
from serving.controlnet.models import build_controlnet_preset
from serving.controlnet.runner import ControlNetCall, ControlNetRunner
from serving.deployments.controlnet import ControlNetCore, ServeControlNets
from serving.deployments.transport import ResolvedTensors
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.types import ControlNetSpec
from serving.presets import build_preset
from tests.helpers.fake_serve import FakeHandle, FakeStore
from tests.helpers.images import square

CPU = torch.device("cpu")
TOLERANCE = 1e-3


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny", "sd3-tiny", "flux-tiny"])
def test_a_requests_image_and_embeddings_travel_once_and_give_the_in_process_image(preset):
    """With SDXL, each row's pooled embedding and size ids travel in the step's call (counted in its bytes); with SD3
    its pooled embedding, and the conditioning image as VAE latents; with Flux (true CFG) its pooled embedding and
    guidance, and the image as packed latents."""
    store, sink = FakeStore(), InMemorySink()
    runner = ControlNetRunner(build_controlnet_preset(preset, seed=1), CPU)
    core = ControlNetCore(runner, ResolvedTensors(get=store.get))
    handle = FakeHandle(residuals=lambda wire: core.forward([wire])[0])
    client = ServeControlNets({"edges": handle}, 30.0, Metrics(sink), put=store.put)
    remote = DiffusionEngine(preset, build_preset(preset), CPU, controlnets=client)
    local = DiffusionEngine(preset, build_preset(preset), CPU, controlnets=LocalControlNets({"edges": runner}))
    flux = {"true_cfg": True, "true_cfg_scale": 4.0, "negative_prompt": "blue"} if preset == "flux-tiny" else {}
    params = GenerationParams("a red square", 64, 64, 3, 6.0, 7, n=2,
                              controlnets=(ControlNetSpec("edges", square(), 0.8),), **flux)
    images, puts = [], []
    for engine in (remote, local):
        state = engine.start(params)
        while not state.done:
            engine.step([state])
            puts.append(store.puts)
        images.append(engine.decode(state))

    assert puts[:3] == [2, 2, 2]  # the conditioning image and the text embeddings, at the first step only
    assert np.abs(images[0] - images[1]).max() <= TOLERANCE
    wires = [wire for (wire,) in handle.residuals.calls]
    assert client.calls_sent == {"edges": len(wires)} and len(wires) == 3  # one call a step
    assert [row for _, row in wires[0].context] == [0, 1, 2, 3]  # both images, unconditional and conditional
    added = {"tiny": {}, "sdxl-tiny": {"text_embeds": (4, 48), "time_ids": (4, 6)},
             "sd3-tiny": {"pooled_projections": (4, 64)},
             "flux-tiny": {"pooled_projections": (4, 32), "guidance": (4,)}}[preset]
    assert {name: value.shape for name, value in wires[0].added.items()} == added
    assert store.gets == 2  # the service resolved each once
    sent = sum(wire.nbytes for wire in wires) + sum(array.nbytes for array in store.objects.values())
    assert sink.total(REMOTE_BYTES, path="controlnet", direction="sent") == sent
    assert sink.total(REMOTE_BYTES, path="controlnet", direction="received") == sum(
        answer.nbytes for answer in handle.residuals.answers) > 0


def _sd3_call(seed: int, rows: int) -> ControlNetCall:
    """An SD3 engine's call: one shifted and scaled control latent for all rows, pooled projections, a latent shift."""
    generator = torch.Generator().manual_seed(seed)
    context = torch.randn(rows, 10, 64, generator=generator)
    return ControlNetCall(sample=torch.randn(rows, 16, 16, 16, generator=generator),
                          timestep=torch.rand(rows, generator=generator) * 1000, encoder_hidden_states=context,
                          context_rows=[(context, row) for row in range(rows)], scales=torch.linspace(0.5, 1.5, rows),
                          images=[(torch.randn(1, 16, 16, 16, generator=generator), rows)],
                          added={"pooled_projections": torch.randn(rows, 64, generator=generator)},
                          latent_shift=0.0609 * 1.5305)


def test_sd3_calls_and_residuals_cross_the_wire_without_a_mid_residual():
    """The latent shift and pooled projections travel with the call (the preset is InstantX-style: the runner adds
    the shift back, so a lost shift changes the residuals); the block samples come back with no mid residual, equal
    to the in-process ones, their bytes counted; the service runs calls of one shape as one forward."""
    store, sink = FakeStore(), InMemorySink()
    runner = ControlNetRunner(build_controlnet_preset("sd3-tiny", seed=1), CPU)
    core = ControlNetCore(runner, ResolvedTensors(get=store.get))
    handle = FakeHandle(residuals=lambda wire: core.forward([wire])[0])
    client = ServeControlNets({"edges": handle}, 30.0, Metrics(sink), put=store.put)
    calls = [_sd3_call(seed=1, rows=2), _sd3_call(seed=2, rows=3)]
    for call in calls:
        remote, local = client.submit("edges", call).result(), runner.run(call)
        assert remote.mid is None and len(remote.down) == len(local.down) == 1
        torch.testing.assert_close(remote.down[0], local.down[0])

    wires = [wire for (wire,) in handle.residuals.calls]
    assert [wire.latent_shift for wire in wires] == [call.latent_shift for call in calls]
    assert [wire.added["pooled_projections"].shape for wire in wires] == [(2, 64), (3, 64)]
    answers = handle.residuals.answers
    assert all(answer.mid is None and answer.nbytes == answer.down[0].nbytes > 0 for answer in answers)
    assert sink.total(REMOTE_BYTES, path="controlnet", direction="received") == sum(a.nbytes for a in answers)
    for together, alone in zip(core.forward(wires), answers, strict=True):
        assert together.mid is None
        np.testing.assert_allclose(together.down[0], alone.down[0], rtol=1e-5, atol=1e-6)
