"""The denoising engine against diffusers' StableDiffusionPipeline, with and without LoRAs."""

import hashlib
import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError
from safetensors.torch import load_file

from serving.config import DiffusionAppConfig, DiffusionModelConfig, EngineConfig, EngineTuning
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, LoRALoadFailed, LoRASpec
from serving.engine.request import PendingLoRA
from serving.lora.cache import LoRACache
from serving.lora.format import load_lora_file
from serving.lora.registry import LoRANotFound, LoRARegistry
from serving.presets import build_preset
from tests.helpers.held_loras import held_loader, prepared, release_once_blocked
from tests.helpers.lora_files import write_lora

TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64,
                  num_inference_steps=4, guidance_scale=7.5, seed=3)
    return GenerationParams(**{**values, **overrides})


def _run(engine: DiffusionEngine, params: GenerationParams, loras=(), activate_at: int | None = None):
    """Denoise one request alone with the engine primitives; LoRAs take effect at step ``activate_at``."""
    state = engine.start(params, list(loras))
    while not state.done:
        if loras and state.step_index == (activate_at or 0) and not state.active_loras:
            engine.activate_loras(state)
        engine.step([state])
    return engine.decode(state)


def _diffusers(params: GenerationParams, lora_files=(), fuse_at_step: int = 0) -> np.ndarray:
    """The same request through diffusers, LoRAs loaded with load_lora_weights + fuse_lora."""
    pipe = build_preset("tiny").as_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def fuse(pipeline):
        for index, (path, _) in enumerate(lora_files):
            pipeline.load_lora_weights(load_file(path), adapter_name=f"l{index}")
        pipeline.set_adapters([f"l{i}" for i in range(len(lora_files))], [scale for _, scale in lora_files])
        pipeline.fuse_lora(components=["unet", "text_encoder"], lora_scale=1.0)

    callback = None
    if lora_files and fuse_at_step == 0:
        fuse(pipe)
    elif lora_files:
        def callback(pipeline, step, timestep, kwargs):
            if step == fuse_at_step - 1:
                fuse(pipeline)
            return kwargs

    return pipe(
        prompt=params.prompt, negative_prompt=params.negative_prompt, num_images_per_prompt=params.n,
        width=params.width, height=params.height, num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale, output_type="np",
        generator=[torch.Generator().manual_seed(params.seed + i) for i in range(params.n)],
        callback_on_step_end=callback,
    ).images


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("loras")
    write_lora(directory / "outlined.safetensors", seed=1, text_encoder=True)
    write_lora(directory / "dark.safetensors", seed=2, rank=8)
    (directory / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    return directory


def _pending(engine: DiffusionEngine, directory: Path, name: str, scale: float) -> PendingLoRA:
    from concurrent.futures import Future

    future: Future = Future()
    future.set_result(load_lora_file(directory / f"{name}.safetensors", engine.lora_targets,
                                     max_file_bytes=2**30))
    return PendingLoRA(name=name, scale=scale, load=future, cache_hit=True)


@pytest.mark.parametrize(("guidance", "negative"), [(1.0, None), (7.5, None), (5.0, "blue")])
def test_engine_matches_diffusers_pipeline(tiny_engine, guidance, negative):
    params = _params(guidance_scale=guidance, negative_prompt=negative, n=2)
    ours = _run(tiny_engine, params)
    assert ours.shape == (2, 64, 64, 3)
    assert np.abs(ours - _diffusers(params)).max() <= TOLERANCE


def test_lora_matches_diffusers_fused(tiny_engine, lora_dir):
    params = _params()
    loras = [_pending(tiny_engine, lora_dir, "outlined", 0.8)]
    ours = _run(tiny_engine, params, loras)
    reference = _diffusers(params, [(lora_dir / "outlined.safetensors", 0.8)])
    assert np.abs(ours - reference).max() <= TOLERANCE
    assert np.abs(ours - _run(tiny_engine, params)).max() > 20 * TOLERANCE  # the LoRA visibly matters


def test_merged_copy_path_matches_diffusers_too(lora_dir):
    merging = DiffusionEngine("tiny", build_preset("tiny"), torch.device("cpu"), lora_merge_after=1)
    params = _params(seed=6)
    loras = [_pending(merging, lora_dir, "outlined", 0.6), _pending(merging, lora_dir, "dark", 0.9)]
    reference = _diffusers(params, [(lora_dir / "outlined.safetensors", 0.6), (lora_dir / "dark.safetensors", 0.9)])
    assert np.abs(_run(merging, params, loras) - reference).max() <= TOLERANCE
    assert merging._denoiser_loras._merged._entries  # steps 2.. ran on merged copies


def test_two_loras_match_diffusers_fused(tiny_engine, lora_dir):
    params = _params(seed=8)
    loras = [_pending(tiny_engine, lora_dir, "outlined", 0.5), _pending(tiny_engine, lora_dir, "dark", -1.2)]
    reference = _diffusers(params, [(lora_dir / "outlined.safetensors", 0.5), (lora_dir / "dark.safetensors", -1.2)])
    assert np.abs(_run(tiny_engine, params, loras) - reference).max() <= TOLERANCE


def test_mixed_batch_gives_each_request_its_own_image(tiny_engine, lora_dir):
    requests = [
        (_params(seed=1, n=2), [_pending(tiny_engine, lora_dir, "outlined", 1.0)]),
        (_params(seed=2, prompt="a blue square", guidance_scale=1.0),
         [_pending(tiny_engine, lora_dir, "outlined", 0.3), _pending(tiny_engine, lora_dir, "dark", 0.7)]),
        (_params(seed=3, negative_prompt="green"), []),
    ]
    alone = [_run(tiny_engine, params, loras) for params, loras in requests]
    states = [tiny_engine.start(params, loras) for params, loras in requests]
    for state, (_, loras) in zip(states, requests, strict=True):
        if loras:
            tiny_engine.activate_loras(state)
    while not all(state.done for state in states):
        tiny_engine.step(states)
    for state, expected in zip(states, alone, strict=True):
        assert np.abs(tiny_engine.decode(state) - expected).max() <= TOLERANCE


def test_lora_arriving_at_step_k_applies_from_step_k(tiny_engine, lora_dir):
    params = _params(num_inference_steps=6, seed=4)
    loras = [_pending(tiny_engine, lora_dir, "dark", 1.0)]
    late = _run(tiny_engine, params, loras, activate_at=3)
    reference = _diffusers(params, [(lora_dir / "dark.safetensors", 1.0)], fuse_at_step=3)
    assert np.abs(late - reference).max() <= TOLERANCE
    assert np.abs(late - _run(tiny_engine, params, loras)).max() > 10 * TOLERANCE


# -- through the engine loop -------------------------------------------------------------------------


def _checksum(engine: DiffusionEngine) -> str:
    digest = hashlib.sha256()
    for module in (engine.denoiser.module, engine.text_encoder, engine.vae):
        for name, tensor in module.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _loop(engine, lora_dir, *, loader=None, on_step=None, **config) -> EngineLoop:
    cache = LoRACache(LoRARegistry(lora_dir), engine.lora_targets, budget_bytes=2**30, max_file_bytes=2**30,
                      **({"loader": loader} if loader else {}))
    return EngineLoop(engine, EngineConfig(**config), cache, on_step=on_step)


def test_lora_arriving_before_the_deadline_applies_from_the_next_step(tiny_engine, lora_dir):
    release = threading.Event()

    def on_step(state):
        if state.step_index == 2:  # the request has run steps 0 and 1 without its LoRA
            release.set()
            prepared(state)

    loop = _loop(tiny_engine, lora_dir, loader=held_loader(tiny_engine, release), on_step=on_step,
                 lora_wait_fraction=0.5)
    try:
        result = loop.submit(_params(num_inference_steps=6, loras=(LoRASpec("dark", 1.0),))).result(timeout=60)
    finally:
        loop.stop()
    assert result.lora is not None
    assert (result.lora.mode, result.lora.applied_at_step, result.lora.cache_hits, result.lora.wait_s) == (
        "async", 2, 0, 0.0)


def test_cold_lora_waits_at_deadline_step_and_reports_it(tiny_engine, lora_dir):
    release = threading.Event()

    def on_step(state):
        if state.step_index == 3:  # steps 0-2 ran without the LoRA; step 3 is the deadline (0.5 of 6)
            threading.Thread(target=release_once_blocked, args=(state, release)).start()

    loop = _loop(tiny_engine, lora_dir, loader=held_loader(tiny_engine, release), on_step=on_step,
                 lora_wait_fraction=0.5)
    try:
        result = loop.submit(_params(num_inference_steps=6, loras=(LoRASpec("dark", 1.0),))).result(timeout=60)
    finally:
        loop.stop()
    assert result.lora is not None
    assert (result.lora.mode, result.lora.applied_at_step, result.lora.cache_hits) == ("async", 3, 0)
    assert result.lora.wait_s > 0  # it stood still at the deadline step until the load finished


def test_exact_mode_waits_for_a_cold_lora_and_gives_the_warm_image(tiny_engine, lora_dir):
    release = threading.Event()
    loop = _loop(tiny_engine, lora_dir, loader=held_loader(tiny_engine, release))
    try:
        cold = loop.submit(_params(seed=9, loras=(LoRASpec("dark", 1.0),), lora_mode="exact"))
        deadline = time.monotonic() + 30
        while not loop._active and time.monotonic() < deadline:  # admitted: it stops before its first step
            time.sleep(0.002)
        release_once_blocked(loop._active[0].state, release)
        cold = cold.result(timeout=60)
        warm = loop.submit(_params(seed=9, loras=(LoRASpec("dark", 1.0),))).result(timeout=60)
    finally:
        loop.stop()
    assert (cold.lora.mode, cold.lora.applied_at_step, cold.lora.cache_hits) == ("exact", 0, 0)
    assert cold.lora.wait_s > 0
    assert (warm.lora.mode, warm.lora.applied_at_step, warm.lora.cache_hits) == ("async", 0, 1)
    assert cold.images == warm.images  # the same PNG bytes: the LoRA applied from the first step both times


def test_cold_lora_in_async_mode_starts_without_it(tiny_engine, lora_dir):
    release = threading.Event()

    def on_step(state):
        if state.step_index == 1:  # step 0 ran without the LoRA
            release.set()
            prepared(state)

    loop = _loop(tiny_engine, lora_dir, loader=held_loader(tiny_engine, release), on_step=on_step)
    try:
        result = loop.submit(_params(seed=9, loras=(LoRASpec("dark", 1.0),))).result(timeout=60)
    finally:
        loop.stop()
    assert (result.lora.mode, result.lora.applied_at_step, result.lora.cache_hits) == ("async", 1, 0)


def test_warm_lora_applies_from_step_zero(tiny_engine, lora_dir):
    loop = _loop(tiny_engine, lora_dir)
    try:
        loop.lora_cache.get("outlined").result(timeout=30)
        result = loop.submit(_params(loras=(LoRASpec("outlined", 1.0),))).result(timeout=60)
    finally:
        loop.stop()
    assert (result.lora.applied_at_step, result.lora.cache_hits, result.lora.wait_s) == (0, 1, 0.0)


def test_short_request_overtakes_long_one_with_continuous_batching(tiny_engine, lora_dir):
    finished = []
    for continuous in (True, False):
        started = threading.Event()

        def on_step(state, started=started):
            if state.params.num_inference_steps == 30 and state.step_index == 2:
                started.set()

        loop = _loop(tiny_engine, lora_dir, on_step=on_step, continuous_batching=continuous,
                     admission_wait_fraction=None)  # the short request waits for the long one
        try:
            long = loop.submit(_params(num_inference_steps=30, seed=1))
            started.wait(timeout=30)
            short = loop.submit(_params(num_inference_steps=2, seed=2))
            order = []
            short.add_done_callback(lambda _, order=order: order.append("short"))
            long.add_done_callback(lambda _, order=order: order.append("long"))
            long.result(timeout=120)
            short.result(timeout=120)
        finally:
            loop.stop()
        finished.append(order)
    assert finished == [["short", "long"], ["long", "short"]]


def test_continuous_batching_on_and_off_give_the_same_images(tiny_engine, lora_dir):
    requests = [_params(seed=1, num_inference_steps=5), _params(seed=2, num_inference_steps=3, n=2),
                _params(seed=3, guidance_scale=1.0, loras=(LoRASpec("dark", 0.5),))]
    images = {}
    for continuous in (True, False):
        loop = _loop(tiny_engine, lora_dir, continuous_batching=continuous)
        try:
            loop.lora_cache.get("dark").result(timeout=30)  # warm: applied from step 0 in both runs
            futures = [loop.submit(params) for params in requests]
            images[continuous] = [np.stack([np.asarray(Image.open(io.BytesIO(png))) for png in f.result(60).images])
                                  for f in futures]
        finally:
            loop.stop()
    for on, off in zip(images[True], images[False], strict=True):
        assert np.abs(on.astype(int) - off.astype(int)).max() <= 1  # PNG levels: batch composition rounding


def test_base_weights_untouched_after_mixed_run_with_failures(tiny_engine, lora_dir):
    before = _checksum(tiny_engine)
    loop = _loop(tiny_engine, lora_dir)
    try:
        futures = [
            loop.submit(_params(seed=1, loras=(LoRASpec("outlined", 2.0), LoRASpec("dark", -1.0)))),
            loop.submit(_params(seed=2, loras=(LoRASpec("broken", 1.0),))),
            loop.submit(_params(seed=3)),
        ]
        with pytest.raises(LoRANotFound):
            loop.submit(_params(loras=(LoRASpec("missing", 1.0),)))
        with pytest.raises(ValueError):
            loop.submit(_params(width=63))
        assert futures[0].result(timeout=60).lora.names == ("outlined", "dark")
        with pytest.raises(LoRALoadFailed, match="broken"):
            futures[1].result(timeout=60)
        assert len(futures[2].result(timeout=60).images) == 1
        assert not loop.lora_cache.contains("broken") and loop.lora_cache.contains("outlined")
        assert loop.lora_cache.stats()["loads_failed"] == 1
    finally:
        loop.stop()
    assert _checksum(tiny_engine) == before


def test_engine_tuning_replaces_only_the_fields_it_sets():
    engine = EngineConfig(max_batch_rows=16, continuous_batching=True, lora_wait_fraction=0.4, remote_timeout_s=5.0)
    assert EngineTuning().apply(engine) == engine
    tuned = EngineTuning(max_batch_rows=3, continuous_batching=False).apply(engine)
    assert tuned == engine.model_copy(update={"max_batch_rows": 3, "continuous_batching": False})
    assert EngineTuning(lora_wait_fraction=0.0).apply(engine).lora_wait_fraction == 0.0  # a falsy value is set
    assert engine.max_batch_rows == 16  # the input is not modified
    for bad in ({"max_batch_rows": 0}, {"lora_wait_fraction": 1.5}, {"remote_timeout_s": 1.0}, {"rows": 3}):
        with pytest.raises(ValidationError):
            EngineTuning.model_validate(bad)


def test_diffusion_replica_reconfigure_tunes_its_running_engine_loop():
    from serving.deployments.model import DiffusionModel

    config = DiffusionAppConfig(model=DiffusionModelConfig(preset="tiny", device="cpu"))
    assert config.controlnets == []
    replica = DiffusionModel.func_or_class(config, {})
    loop = replica._backend.loop
    try:
        before = loop.config
        assert before == config.engine
        replica.reconfigure({"max_batch_rows": 3})
        assert loop.config == before.model_copy(update={"max_batch_rows": 3})
        replica.reconfigure({})  # Serve passes the whole user_config: an empty one changes nothing
        assert loop.config.max_batch_rows == 3
        for bad in ({"max_batch_rows": 0}, {"max_batch_size": 3}):
            with pytest.raises(ValidationError):
                replica.reconfigure(bad)
            assert loop.config.max_batch_rows == 3  # a refused user_config leaves the engine as it was
        # The loop keeps serving with the new config.
        result = loop.submit(_params(num_inference_steps=2)).result(timeout=120)
        assert len(result.images) == 1
    finally:
        replica._backend.close()
