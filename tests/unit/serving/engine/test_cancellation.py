"""Cancelled requests: dropped at the next step boundary, never started when still queued, never decoded once
denoised, their unshared LoRA loads dropped, and counted by stage."""

import asyncio
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from serving.common.metrics import CANCELLED_REQUESTS, REQUEST_LATENCY, Metrics
from serving.config import EngineConfig
from serving.engine import EngineLoop, GenerationParams, LocalBackend, LoRASpec, PartialImage
from serving.lora.cache import LoRACache
from serving.lora.registry import LoRARegistry
from tests.helpers.awaited_metrics import AwaitedSink
from tests.helpers.held_loras import held_loader
from tests.helpers.images import decode_png
from tests.helpers.lora_files import write_lora

TIMEOUT_S = 60


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=6,
                  guidance_scale=7.5, seed=3)
    return GenerationParams(**{**values, **overrides})


class _Steps:
    """An ``on_step`` hook: counts each request's steps (by seed); at ``hold_at`` steps of request ``hold_seed`` it
    signals ``reached`` and holds the loop thread until ``go`` is set."""

    def __init__(self, hold_seed: int | None = None, hold_at: int | None = None) -> None:
        self.counts: Counter[int] = Counter()
        self.hold_seed, self.hold_at = hold_seed, hold_at
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, state) -> None:
        self.counts[state.params.seed] += 1
        if state.params.seed == self.hold_seed and state.step_index == self.hold_at:
            self.reached.set()
            assert self.go.wait(TIMEOUT_S), "the test never let the loop go on"


def _cancelled(sink: AwaitedSink) -> dict[str, float]:
    return {stage: sink.total(CANCELLED_REQUESTS, stage=stage) for stage in ("queued", "denoising", "decoding")}


@pytest.fixture
def sink() -> AwaitedSink:
    return AwaitedSink()


def test_a_request_cancelled_mid_denoising_takes_no_further_step_and_the_other_is_unchanged(tiny_engine, sink):
    steps = _Steps(hold_seed=1, hold_at=2)
    loop = EngineLoop(tiny_engine, EngineConfig(admission_wait_fraction=None), on_step=steps,
                      metrics=Metrics(sink))
    try:
        cancelled, kept = loop.submit(_params(seed=1)), loop.submit(_params(seed=2))
        assert steps.reached.wait(TIMEOUT_S)  # request 1 has taken 2 of its 6 steps
        assert cancelled.cancel()
        steps.go.set()
        kept_images = kept.result(timeout=TIMEOUT_S).images
        sink.wait_for(CANCELLED_REQUESTS)
        alone = loop.submit(_params(seed=2)).result(timeout=TIMEOUT_S).images
    finally:
        steps.go.set()
        loop.stop()
    assert steps.counts[1] == 2  # cancelled between two steps: dropped at the next boundary, no step more
    assert steps.counts[2] == 12  # all 6 steps, then 6 more alone
    assert _cancelled(sink) == {"queued": 0, "denoising": 1, "decoding": 0}
    # the same image as alone, up to batch composition rounding (it shared two steps with the cancelled one)
    assert np.abs(decode_png(kept_images[0]).astype(int) - decode_png(alone[0]).astype(int)).max() <= 1


def test_a_cancelled_queued_request_never_starts(tiny_engine, sink, monkeypatch):
    started: list[int] = []
    start = tiny_engine.start

    def counted_start(params, *args):
        started.append(params.seed)
        return start(params, *args)

    monkeypatch.setattr(tiny_engine, "start", counted_start)
    steps = _Steps()
    previewing, release = threading.Event(), threading.Event()

    def hold_stage_thread(_: PartialImage) -> None:  # the stage thread runs one thing at a time
        previewing.set()
        assert release.wait(TIMEOUT_S)

    loop = EngineLoop(tiny_engine, EngineConfig(admission_wait_fraction=None), on_step=steps, metrics=Metrics(sink))
    try:
        running = loop.submit(_params(seed=1, num_inference_steps=4, partial_images=1), on_preview=hold_stage_thread)
        assert previewing.wait(TIMEOUT_S)
        queued = loop.submit(_params(seed=2))  # its preparation waits behind the held preview
        assert queued.cancel()
        assert _cancelled(sink) == {"queued": 1, "denoising": 0, "decoding": 0}  # dropped at once
        release.set()
        assert len(running.result(timeout=TIMEOUT_S).images) == 1
    finally:
        release.set()
        loop.stop()
    assert started == [1] and steps.counts == {1: 4}


def test_a_request_cancelled_after_its_last_step_is_not_decoded(tiny_engine, sink, monkeypatch):
    decoded: list[int] = []
    decode = tiny_engine.decode

    def counted_decode(state):
        decoded.append(state.params.seed)
        return decode(state)

    monkeypatch.setattr(tiny_engine, "decode", counted_decode)
    steps = _Steps(hold_seed=1, hold_at=4)
    loop = EngineLoop(tiny_engine, EngineConfig(), on_step=steps, metrics=Metrics(sink))
    try:
        future = loop.submit(_params(seed=1, num_inference_steps=4))
        assert steps.reached.wait(TIMEOUT_S)  # denoised, not yet handed to the stage thread
        assert future.cancel()
        steps.go.set()
        sink.wait_for(CANCELLED_REQUESTS)
    finally:
        steps.go.set()
        loop.stop()
    assert decoded == [] and _cancelled(sink) == {"queued": 0, "denoising": 0, "decoding": 1}


def test_closing_a_stream_early_cancels_its_request(tiny_engine, sink):
    steps = _Steps(hold_seed=1, hold_at=4)  # 6 steps: the preview is taken after step 3
    metrics = Metrics(sink)
    backend = LocalBackend(EngineLoop(tiny_engine, EngineConfig(), on_step=steps, metrics=metrics), metrics)

    async def leave_after_the_preview() -> object:
        stream = backend.generate_stream(_params(seed=1, partial_images=1))
        first = await anext(stream)
        await stream.aclose()
        return first

    try:
        first = asyncio.run(leave_after_the_preview())
        steps.go.set()
        sink.wait_for(CANCELLED_REQUESTS)
    finally:
        steps.go.set()
        backend.close()
    assert isinstance(first, PartialImage) and first.step == 3
    assert steps.counts[1] == 4  # held at step 4 until the stream was closed, then dropped
    assert _cancelled(sink) == {"queued": 0, "denoising": 1, "decoding": 0}
    assert [record.tags["status"] for record in sink.records(REQUEST_LATENCY)] == ["cancelled"]


def test_a_cancelled_requests_lora_load_is_dropped_unless_shared_or_begun(tiny_engine, sink, tmp_path: Path):
    write_lora(tmp_path / "dark.safetensors", seed=2, rank=8)
    write_lora(tmp_path / "outlined.safetensors", seed=1)
    release = threading.Event()
    held = held_loader(tiny_engine, release)
    loaded: list[str] = []

    def load(path: Path):
        loaded.append(path.stem)
        return held(path)

    cache = LoRACache(LoRARegistry(tmp_path), tiny_engine.lora_targets, budget_bytes=2**30, max_file_bytes=2**30,
                      max_workers=1, loader=load)
    loop = EngineLoop(tiny_engine, EngineConfig(admission_wait_fraction=None), cache, metrics=Metrics(sink))
    try:
        keeps = loop.submit(_params(seed=1, loras=(LoRASpec("dark"),)))  # its load holds the one load worker
        shares = loop.submit(_params(seed=2, loras=(LoRASpec("dark"),)))
        alone = loop.submit(_params(seed=3, loras=(LoRASpec("outlined"),)))  # its load queued behind
        assert shares.cancel() and alone.cancel()
        sink.wait_for(CANCELLED_REQUESTS, 2)  # their loads are released before they are counted
        assert cache.stats()["loads_cancelled"] == 1 and cache.stats()["loading"] == 1
        release.set()
        assert keeps.result(timeout=TIMEOUT_S).lora.names == ("dark",)
    finally:
        release.set()
        loop.stop()
        cache.close()
    assert loaded == ["dark"]  # "outlined" was never read; "dark", shared, was kept for the request still waiting
