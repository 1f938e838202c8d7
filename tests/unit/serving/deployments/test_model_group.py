"""The model group replica's own methods, called on its class without Serve: every model in one replica, their
engine loops on one shared core."""

import asyncio
import os

from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, DiffusionModelConfig, ImagesAppConfig
from serving.deployments.model_group import DiffusionModelGroup
from serving.engine import GenerationParams, GenerationResult, PartialImage

PARAMS = GenerationParams(prompt="a red circle", width=64, height=64, num_inference_steps=2, guidance_scale=7.5,
                          seed=0)


def _group() -> DiffusionModelGroup:
    config = ImagesAppConfig(shared_replicas=True, models=[
        DiffusionAppConfig(model=DiffusionModelConfig(name=name, preset="tiny", weights="seeded", seed=seed,
                                                    device="cpu"))
        for seed, name in enumerate(("a", "b"))])
    return DiffusionModelGroup.func_or_class(config, {}, {})


def test_each_call_reaches_the_model_it_names_and_the_loops_share_one_core():
    group = _group()
    try:
        infos = [asyncio.run(group.model_info(name)).name for name in ("a", "b")]
        images = {name: asyncio.run(group.generate(name, PARAMS)).images for name in ("a", "b")}
        pid, busy = asyncio.run(group.engine_busy())
        loops = [backend.loop for backend in group._backends.values()]
    finally:
        for backend in group._backends.values():
            backend.close()
    assert infos == ["a", "b"]
    assert images["a"] != images["b"]  # two models, seeded apart
    assert busy == sum(loop.busy_s for loop in loops) > 0
    assert pid == os.getpid()
    assert loops[0]._core is loops[1]._core is not None


def test_the_group_streams_previews_then_the_result_and_answers_a_refusal_as_its_one_event():
    group = _group()

    async def events(model: str, request: GenerationParams) -> list[object]:
        return [event async for event in group.generate_stream(model, request)]

    try:
        preview, result = asyncio.run(events("b", GenerationParams(**{**PARAMS.__dict__, "partial_images": 1})))
        refused = asyncio.run(events("a", GenerationParams(**{**PARAMS.__dict__, "width": 60})))
        tuned = group.reconfigure({"max_batch_rows": 4})
        rows = [backend.loop.config.max_batch_rows for backend in group._backends.values()]
    finally:
        for backend in group._backends.values():
            backend.close()
    assert isinstance(preview, PartialImage) and isinstance(result, GenerationResult)
    assert len(refused) == 1 and isinstance(refused[0], APIError) and refused[0].status_code == 400
    assert tuned is None and rows == [4, 4]
