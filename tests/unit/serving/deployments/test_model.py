"""The model replica's own methods, called on its class without Serve."""

import asyncio
import time

from serving.config import DiffusionAppConfig, DiffusionModelConfig
from serving.deployments.model import DiffusionModel
from serving.engine import GenerationParams


def test_replica_reports_the_seconds_its_engine_spent_in_denoising_steps():
    config = DiffusionAppConfig(model=DiffusionModelConfig(preset="tiny", device="cpu"))
    replica = DiffusionModel.func_or_class(config, {})
    params = GenerationParams(prompt="a red circle", width=64, height=64, num_inference_steps=2, guidance_scale=7.5,
                              seed=0)
    try:
        assert asyncio.run(replica.engine_busy_s()) == 0.0  # nothing denoised yet
        started = time.perf_counter()
        result = asyncio.run(replica.generate(params))
        elapsed = time.perf_counter() - started
        assert len(result.images) == 1
        # The steps ran while the request was in flight: some time, never more than the request took.
        assert 0.0 < asyncio.run(replica.engine_busy_s()) <= elapsed
    finally:
        replica._backend.close()
