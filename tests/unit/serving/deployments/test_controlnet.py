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
from serving.controlnet.runner import ControlNetRunner
from serving.deployments.controlnet import ControlNetCore, ServeControlNets
from serving.deployments.transport import ResolvedTensors
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.types import ControlNetSpec
from serving.presets import build_preset
from tests.helpers.fake_serve import FakeHandle, FakeStore
from tests.helpers.images import square

CPU = torch.device("cpu")
TOLERANCE = 1e-3


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny"])
def test_a_requests_image_and_embeddings_travel_once_and_give_the_in_process_image(preset):
    """With SDXL, each row's pooled embedding and size ids travel in the step's call (counted in its bytes)."""
    store, sink = FakeStore(), InMemorySink()
    runner = ControlNetRunner(build_controlnet_preset(preset, seed=1), CPU)
    core = ControlNetCore(runner, ResolvedTensors(get=store.get))
    handle = FakeHandle(residuals=lambda wire: core.forward([wire])[0])
    remote = DiffusionEngine(preset, build_preset(preset), CPU,
                             controlnets=ServeControlNets({"edges": handle}, 30.0, Metrics(sink), put=store.put))
    local = DiffusionEngine(preset, build_preset(preset), CPU, controlnets=LocalControlNets({"edges": runner}))
    params = GenerationParams("a red square", 64, 64, 3, 6.0, 7, n=2,
                              controlnets=(ControlNetSpec("edges", square(), 0.8),))
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
    assert [row for _, row in wires[0].context] == [0, 1, 2, 3]  # both images, unconditional and conditional
    added = {"text_embeds": (4, 32), "time_ids": (4, 6)} if preset == "sdxl-tiny" else {}
    assert {name: value.shape for name, value in wires[0].added.items()} == added
    assert store.gets == 2  # the service resolved each once
    sent = sum(wire.nbytes for wire in wires) + sum(array.nbytes for array in store.objects.values())
    assert sink.total(REMOTE_BYTES, path="controlnet", direction="sent") == sent
    assert sink.total(REMOTE_BYTES, path="controlnet", direction="received") == sum(
        answer.nbytes for answer in handle.residuals.answers) > 0
