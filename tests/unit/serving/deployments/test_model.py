"""The model replica's own methods, called on its class without Serve."""

import asyncio
import os
import time
from dataclasses import replace

from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, DiffusionModelConfig
from serving.deployments.model import DiffusionModel
from serving.engine import GenerationParams, GenerationResult, PartialImage


def test_replica_reports_the_seconds_its_engine_spent_in_denoising_steps():
    config = DiffusionAppConfig(model=DiffusionModelConfig(preset="tiny", device="cpu"))
    replica = DiffusionModel.func_or_class(config, {})
    params = GenerationParams(prompt="a red circle", width=64, height=64, num_inference_steps=2, guidance_scale=7.5,
                              seed=0)
    try:
        assert asyncio.run(replica.engine_busy()) == (os.getpid(), 0.0)  # nothing denoised yet
        started = time.perf_counter()
        result = asyncio.run(replica.generate(params))
        elapsed = time.perf_counter() - started
        assert len(result.images) == 1
        # The steps ran while the request was in flight: some time, never more than the request took.
        assert 0.0 < asyncio.run(replica.engine_busy())[1] <= elapsed
    finally:
        replica._backend.close()


def test_replica_streams_previews_then_the_result_and_answers_a_refusal_as_its_one_event():
    config = DiffusionAppConfig(model=DiffusionModelConfig(preset="tiny", device="cpu"))
    replica = DiffusionModel.func_or_class(config, {})
    params = GenerationParams(prompt="a red circle", width=64, height=64, num_inference_steps=2, guidance_scale=7.5,
                              seed=0, partial_images=1)

    async def events(request: GenerationParams) -> list[object]:
        return [event async for event in replica.generate_stream(request)]

    try:
        preview, result = asyncio.run(events(params))
        refused = asyncio.run(events(replace(params, width=60)))  # not a multiple of 8
    finally:
        replica._backend.close()
    assert isinstance(preview, PartialImage) and (preview.step, preview.image_index) == (1, 0)
    assert isinstance(result, GenerationResult) and len(result.images) == 1
    assert len(refused) == 1 and isinstance(refused[0], APIError) and refused[0].status_code == 400
