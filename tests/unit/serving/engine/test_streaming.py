"""Streamed previews: which steps and images the engine loop previews, in what order, and ``generate_stream``."""

import asyncio
import io
import threading

import pytest
from PIL import Image

from serving.config import EngineConfig
from serving.engine import EngineLoop, GenerationParams, GenerationResult, LocalBackend, PartialImage
from serving.engine.preview import preview_steps

TIMEOUT_S = 60


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=4,
                  guidance_scale=7.5, seed=3)
    return GenerationParams(**{**values, **overrides})


def _size(png: bytes) -> tuple[int, int, str]:
    image = Image.open(io.BytesIO(png))
    return (*image.size, image.mode)


@pytest.fixture
def loop(tiny_engine):
    loop = EngineLoop(tiny_engine, EngineConfig(admission_wait_fraction=None))
    yield loop
    loop.stop()


@pytest.mark.parametrize("partial_images", [1, 2, 3])
def test_the_loop_previews_every_image_at_the_chosen_steps_before_its_result(loop, partial_images):
    events: list[PartialImage | str] = []  # both are appended on the stage thread, in the order they happen
    future = loop.submit(_params(n=2, partial_images=partial_images), on_preview=events.append)
    future.add_done_callback(lambda _: events.append("result"))
    result = future.result(timeout=TIMEOUT_S)
    assert events[-1] == "result" and len(result.images) == 2
    previews = events[:-1]
    steps = {1: [2], 2: [1, 3], 3: [1, 2, 3]}[partial_images]  # 4 steps: evenly spaced, none the last
    assert [(p.partial_index, p.step, p.image_index) for p in previews] == [
        (index, step, image) for index, step in enumerate(steps) for image in (0, 1)]
    assert all(_size(p.png) == (64, 64, "RGB") for p in previews)
    assert previews[0].png != previews[1].png  # each image its own preview (seeds 3 and 4)


def test_no_previews_without_partial_images_or_without_a_callback(loop):
    previews: list[PartialImage] = []
    loop.submit(_params(), on_preview=previews.append).result(timeout=TIMEOUT_S)
    assert len(loop.submit(_params(partial_images=2)).result(timeout=TIMEOUT_S).images) == 1
    assert previews == []


def test_a_failing_preview_callback_leaves_the_request_to_finish(loop, all_logs):
    def broken(_: PartialImage) -> None:
        raise RuntimeError("the consumer is gone")

    result = loop.submit(_params(partial_images=1), on_preview=broken).result(timeout=TIMEOUT_S)
    assert len(result.images) == 1
    assert "preview after step 2 failed" in all_logs.text


def test_the_loop_thread_never_waits_on_a_preview(tiny_engine):
    """A preview callback held back holds up the stage thread only: the request denoises to its last step."""
    release = threading.Event()
    last_step = threading.Event()

    def on_step(state) -> None:
        if state.done:
            last_step.set()

    loop = EngineLoop(tiny_engine, EngineConfig(), on_step=on_step)
    try:
        future = loop.submit(_params(partial_images=1), on_preview=lambda _: release.wait(TIMEOUT_S))
        assert last_step.wait(TIMEOUT_S)  # denoised while its preview is still being delivered
        assert not future.done()
        release.set()
        assert len(future.result(timeout=TIMEOUT_S).images) == 1
    finally:
        release.set()
        loop.stop()


async def _collect(backend: LocalBackend, params: GenerationParams) -> list[PartialImage | GenerationResult]:
    return [event async for event in backend.generate_stream(params)]


def test_generate_stream_yields_the_previews_then_the_result_generate_gives(loop):
    backend = LocalBackend(loop)
    params = _params(n=2, num_inference_steps=6, partial_images=3)
    events = asyncio.run(_collect(backend, params))
    *previews, result = events
    assert all(isinstance(event, PartialImage) for event in previews) and isinstance(result, GenerationResult)
    assert [(p.step, p.image_index) for p in previews] == [
        (step, image) for step in preview_steps(6, 3) for image in (0, 1)]
    assert result.images == asyncio.run(backend.generate(params)).images  # previews change nothing of the result


def test_a_stream_without_partial_images_yields_only_the_result(loop):
    events = asyncio.run(_collect(LocalBackend(loop), _params(num_inference_steps=3)))
    assert len(events) == 1 and isinstance(events[0], GenerationResult)
