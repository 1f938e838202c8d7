"""Flux.1 (``flux-tiny``: a Flux transformer over 2x2-packed latents, a CLIP encoder's pooled output, a T5 encoder,
the guidance embedding, a schedule shifted by image size) against diffusers' Flux pipelines, same components and
seeds: text-to-image ([dev] and [schnell] style), true CFG, rows of different guidance in one forward, LoRAs in
diffusers', kohya's and XLabs' formats, ControlNets as a service, edits, local directories, the images API."""

import base64
import io
import threading
import time

import numpy as np
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline, UniPCMultistepScheduler
from PIL import Image
from safetensors.torch import load_file

from serving.config import (
    ControlNetConfig,
    DiffusionAppConfig,
    DiffusionModelConfig,
    EngineConfig,
    GenerationDefaults,
)
from serving.controlnet.models import build_controlnet_preset
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, LocalBackend, LoRASpec
from serving.engine.cfg import LocalCFGWorker
from serving.engine.types import EditImage
from serving.lora.cache import LoRACache
from serving.lora.format import LoRAFormatError, LoRATargets, load_lora_file
from serving.lora.registry import LoRARegistry
from serving.presets import build_preset, load_local
from tests.helpers.denoising import denoise_together, loaded_lora, pipeline_images
from tests.helpers.held_loras import held_loader, release_once_blocked
from tests.helpers.images import shape_image
from tests.helpers.images_api import images_client
from tests.helpers.lora_files import write_flux_lora, write_lora
from tests.helpers.transformer_controlnets import control_specs, local_services, reference_images, seeded_controlnets

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale


def _engine(components=None, **kwargs) -> DiffusionEngine:
    return DiffusionEngine("flux-tiny", components or build_preset("flux-tiny"), CPU, **kwargs)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=2,
                  guidance_scale=3.5, seed=3, true_cfg=True)
    return GenerationParams(**{**values, **overrides})


def _reference(pipe, params: GenerationParams, **extra) -> np.ndarray:
    return pipeline_images(pipe, params, true_cfg_scale=params.true_cfg_scale, **extra)


@pytest.mark.parametrize("overrides", [
    {},  # [dev]: the guidance scale is the guidance embedding's; no CFG
    {"n": 2, "guidance_scale": 5.0},
    {"width": 48, "height": 80},  # another token count: another shift of the schedule
    {"negative_prompt": "a blue square", "true_cfg_scale": 4.0},  # true CFG: two passes per step
    {"negative_prompt": "a blue square"},  # a negative prompt at true_cfg_scale 1: no CFG, as diffusers
], ids=["dev", "n2", "48x80", "true-cfg", "negative-without-true-cfg"])
def test_images_equal_diffusers_flux_pipeline(overrides):
    params = _params(**overrides)
    ours = denoise_together(_engine(), [(params, [])])[0]
    assert ours.shape == (params.n, params.height, params.width, 3)
    assert params.uses_cfg == ("true_cfg_scale" in overrides)
    assert np.abs(ours - _reference(build_preset("flux-tiny").as_pipeline(), params)).max() <= TOLERANCE


def test_a_schnell_style_model_has_no_guidance_embedding_and_an_unshifted_schedule():
    params = _params(num_inference_steps=3)
    ours = denoise_together(_engine(build_preset("flux-schnell-tiny")), [(params, [])])[0]
    reference = _reference(build_preset("flux-schnell-tiny").as_pipeline(), params)
    assert np.abs(ours - reference).max() <= TOLERANCE
    other_guidance = denoise_together(_engine(build_preset("flux-schnell-tiny")),
                                      [(_params(num_inference_steps=3, guidance_scale=9.0), [])])[0]
    np.testing.assert_array_equal(ours, other_guidance)  # nothing takes the guidance scale


def test_requests_with_different_guidance_share_a_forward_each_as_alone():
    """Continuous batching of [dev] requests: each row carries its own guidance into the embedding."""
    engine = _engine()
    requests = [_params(seed=1, guidance_scale=2.0), _params(seed=2, guidance_scale=6.0, n=2),
                _params(seed=3, negative_prompt="blue", true_cfg_scale=3.0)]
    states = [engine.start(params) for params in requests]
    while not all(state.done for state in states):
        engine.step([state for state in states if not state.done])
    together = [engine.decode(state) for state in states]
    for params, image in zip(requests, together, strict=True):
        np.testing.assert_allclose(image, denoise_together(_engine(), [(params, [])])[0], atol=1e-5)
    same_seed = denoise_together(_engine(), [(_params(seed=1, guidance_scale=6.0), [])])[0]
    assert np.abs(together[0] - same_seed).max() > 0.01  # the guidance reached the rows


def test_parallel_true_cfg_on_a_local_worker_gives_the_images_of_one_engine():
    requests = [(_params(seed=1, negative_prompt="blue", true_cfg_scale=3.0), []), (_params(seed=2, n=2), [])]
    worker = LocalCFGWorker(_engine())
    try:
        split = denoise_together(_engine(cfg_worker=worker), requests)
    finally:
        worker.close()
    for image, alone in zip(split, denoise_together(_engine(), requests), strict=True):
        assert np.abs(image - alone).max() <= TOLERANCE


def test_a_flux_request_streams_its_previews_through_the_engine_loop():
    previews = []
    loop = EngineLoop(_engine(), EngineConfig())
    try:
        result = loop.submit(_params(num_inference_steps=4, partial_images=2, n=2),
                             on_preview=previews.append).result(timeout=120)
    finally:
        loop.stop()
    assert sorted((preview.step, preview.image_index) for preview in previews) == [(1, 0), (1, 1), (3, 0), (3, 1)]
    assert all(np.asarray(Image.open(io.BytesIO(preview.png))).shape == (64, 64, 3) for preview in previews)
    assert len(result.images) == 2


def test_flux_offers_the_flow_schedulers_that_take_its_sigmas():
    engine = _engine()
    assert engine.info.schedulers == ("euler", "unipc")
    assert engine.info.family == "flux" and engine.info.true_cfg


def test_a_flux_request_naming_unipc_equals_diffusers_with_that_scheduler():
    params = _params(scheduler="unipc", num_inference_steps=3)
    ours = denoise_together(_engine(), [(params, [])])[0]
    pipe = build_preset("flux-tiny").as_pipeline()
    config = pipe.scheduler.config
    pipe.scheduler = UniPCMultistepScheduler.from_config(config, use_flow_sigmas=True,
                                                         prediction_type="flow_prediction", flow_shift=config.shift)
    assert np.abs(ours - _reference(pipe, params)).max() <= TOLERANCE
    assert np.abs(ours - denoise_together(_engine(), [(_params(num_inference_steps=3), [])])[0]).max() > TOLERANCE


def test_a_diffusers_format_lora_on_the_transformer_and_clip_equals_diffusers_fused(tmp_path):
    path = write_lora(tmp_path / "style.safetensors", seed=5, text_encoder=True, preset="flux-tiny")
    engine = _engine()
    lora = loaded_lora(engine, path, 0.7)
    weights = lora.load.result()
    assert weights.denoiser and weights.text_encoder and not weights.text_encoder_2
    params = _params()
    ours = denoise_together(engine, [(params, [lora])])[0]
    pipe = build_preset("flux-tiny").as_pipeline()
    pipe.load_lora_weights(load_file(path))
    pipe.fuse_lora(components=["transformer", "text_encoder"], lora_scale=0.7)
    assert np.abs(ours - _reference(pipe, params)).max() <= TOLERANCE
    assert np.abs(ours - denoise_together(engine, [(params, [])])[0]).max() > 20 * TOLERANCE


@pytest.mark.parametrize(("style", "text_encoder"), [("kohya", False), ("kohya", True), ("xlabs", False)],
                         ids=["kohya", "kohya-te", "xlabs"])
def test_kohya_and_xlabs_loras_load_as_diffusers_converts_them(tmp_path, style, text_encoder):
    path = write_flux_lora(tmp_path / f"{style}.safetensors", seed=7, style=style, text_encoder=text_encoder)
    engine = _engine()
    lora = loaded_lora(engine, path, 0.8)
    assert bool(lora.load.result().text_encoder) == text_encoder
    params = _params()
    ours = denoise_together(engine, [(params, [lora])])[0]
    pipe = build_preset("flux-tiny").as_pipeline()
    pipe.load_lora_weights(load_file(path))
    pipe.fuse_lora(components=["transformer", "text_encoder"] if text_encoder else ["transformer"], lora_scale=0.8)
    assert np.abs(ours - _reference(pipe, params)).max() <= TOLERANCE
    assert np.abs(ours - denoise_together(engine, [(params, [])])[0]).max() > 20 * TOLERANCE


def test_flux_requests_with_different_loras_share_a_forward_each_as_alone(tmp_path):
    """Unmerged per-row LoRAs on the transformer (and the CLIP encoder): two LoRAs of two formats and a request
    without, stepped together."""
    engine = _engine()
    first = loaded_lora(engine, write_lora(tmp_path / "peft.safetensors", seed=1, text_encoder=True,
                                           preset="flux-tiny"), 0.8)
    second = loaded_lora(engine, write_flux_lora(tmp_path / "kohya.safetensors", seed=2, style="kohya"), 0.6)
    requests = [(_params(seed=1), [first]), (_params(seed=2, n=2), [second]), (_params(seed=3), [])]
    together = denoise_together(engine, requests)
    for (params, loras), image in zip(requests, together, strict=True):
        np.testing.assert_allclose(image, denoise_together(engine, [(params, loras)])[0], atol=1e-5)
    assert np.abs(together[0] - denoise_together(engine, [(_params(seed=1), [])])[0]).max() > 20 * TOLERANCE


def test_merged_copies_of_a_flux_lora_give_diffusers_fused_image(tmp_path):
    path = write_flux_lora(tmp_path / "kohya.safetensors", seed=3, style="kohya")
    engine = _engine(lora_merge_after=1)
    params = _params(num_inference_steps=3)
    ours = denoise_together(engine, [(params, [loaded_lora(engine, path, 0.9)])])[0]
    assert engine._denoiser_loras._merged._entries  # steps 2.. ran on merged copies of the transformer's modules
    pipe = build_preset("flux-tiny").as_pipeline()
    pipe.load_lora_weights(load_file(path))
    pipe.fuse_lora(components=["transformer"], lora_scale=0.9)
    assert np.abs(ours - _reference(pipe, params)).max() <= TOLERANCE


def _lora_loop(engine: DiffusionEngine, lora_dir, release: threading.Event, **config) -> EngineLoop:
    cache = LoRACache(LoRARegistry(lora_dir), engine.lora_targets, budget_bytes=2**30, max_file_bytes=2**30,
                      loader=held_loader(engine, release))
    return EngineLoop(engine, EngineConfig(**config), cache)


def test_a_cold_flux_lora_loads_in_the_background_or_in_exact_mode_holds_the_request(tmp_path):
    """Async: the request starts without its LoRA and takes it at the deadline step; exact: it waits before its first
    step and gives the warm LoRA's image."""
    write_flux_lora(tmp_path / "style.safetensors", seed=4, style="xlabs")
    engine, release = _engine(), threading.Event()
    loop = _lora_loop(engine, tmp_path, release, lora_wait_fraction=0.5)
    lora = (LoRASpec("style", 1.0),)
    try:
        background = loop.submit(_params(seed=9, num_inference_steps=4, loras=lora))
        release_once_blocked(_admitted(loop), release)
        background = background.result(timeout=120)
    finally:
        loop.stop()
    assert (background.lora.mode, background.lora.applied_at_step, background.lora.cache_hits) == ("async", 2, 0)

    release = threading.Event()
    loop = _lora_loop(_engine(), tmp_path, release)
    try:
        exact = loop.submit(_params(seed=9, num_inference_steps=4, loras=lora, lora_mode="exact"))
        release_once_blocked(_admitted(loop), release)
        exact = exact.result(timeout=120)
        warm = loop.submit(_params(seed=9, num_inference_steps=4, loras=lora)).result(timeout=120)
    finally:
        loop.stop()
    assert (exact.lora.mode, exact.lora.applied_at_step, exact.lora.cache_hits) == ("exact", 0, 0)
    assert (warm.lora.applied_at_step, warm.lora.cache_hits) == (0, 1)
    assert exact.images == warm.images != background.images


def _admitted(loop: EngineLoop):
    """The state of the loop's first admitted request (waits for the admission)."""
    deadline = time.monotonic() + 60
    while not loop._active and time.monotonic() < deadline:
        time.sleep(0.002)
    return loop._active[0].state


def test_a_flux_request_cancelled_mid_denoising_takes_no_further_step():
    steps, reached, go = [], threading.Event(), threading.Event()

    def on_step(state) -> None:
        steps.append(state.params.seed)
        if state.params.seed == 1 and state.step_index == 2:
            reached.set()
            assert go.wait(60)

    loop = EngineLoop(_engine(), EngineConfig(admission_wait_fraction=None), on_step=on_step)
    try:
        cancelled, kept = loop.submit(_params(seed=1, num_inference_steps=5)), loop.submit(_params(seed=2))
        assert reached.wait(120)
        assert cancelled.cancel()
        go.set()
        assert len(kept.result(timeout=120).images) == 1
    finally:
        go.set()
        loop.stop()
    assert steps.count(1) == 2 and steps.count(2) == 2


@pytest.mark.parametrize(("preset", "message"), [
    ("tiny", "a LoRA for the sd or sdxl family, and this model is flux"),
    ("sdxl-tiny", "a LoRA for the sdxl family, and this model is flux"),
])
def test_loras_of_other_families_are_refused_naming_the_family(tmp_path, preset, message):
    path = write_lora(tmp_path / f"{preset}.safetensors", seed=5, text_encoder=True, preset=preset)
    flux = build_preset("flux-tiny")
    with pytest.raises(LoRAFormatError, match=message):
        load_lora_file(path, LoRATargets.from_modules(flux.denoiser, flux.text_encoder), max_file_bytes=2**30)


@pytest.mark.parametrize("style", ["kohya", "xlabs"])
def test_a_flux_lora_is_refused_by_the_other_families_naming_flux(tmp_path, style):
    path = write_flux_lora(tmp_path / f"{style}.safetensors", seed=7, style=style)
    for preset in ("tiny", "sdxl-tiny", "sd3-tiny"):
        components = build_preset(preset)
        targets = LoRATargets.from_modules(components.denoiser, components.text_encoder, components.text_encoder_2)
        with pytest.raises(LoRAFormatError, match=f"a LoRA for the flux family, and this model is {targets.family}"):
            load_lora_file(path, targets, max_file_bytes=2**30)


@pytest.mark.parametrize("names", [("edges",), ("edges", "mask")], ids=["one", "two"])
def test_flux_controlnets_match_diffusers_flux_controlnet_pipeline(names, monkeypatch):
    """ControlNets as a service: block and single-block samples join the transformer's blocks; two sum like
    FluxMultiControlNetModel."""
    controlnets = seeded_controlnets("flux-tiny")
    params = _params(controlnets=control_specs(names), n=2)
    ours = denoise_together(_engine(controlnets=local_services(controlnets)), [(params, [])])[0]
    reference = reference_images("flux-tiny", controlnets, params, monkeypatch, true_cfg_scale=params.true_cfg_scale)
    assert np.abs(ours - reference).max() <= TOLERANCE
    plain = denoise_together(_engine(), [(_params(n=2), [])])[0]
    assert np.abs(ours - plain).max() > 20 * TOLERANCE


@pytest.mark.parametrize(("preset", "family"), [("tiny", "sd"), ("sdxl-tiny", "sdxl")])
def test_a_local_controlnet_of_another_family_is_refused_at_startup_naming_it(tmp_path, preset, family):
    build_controlnet_preset(preset).save_pretrained(tmp_path / "edges", safe_serialization=True)
    config = DiffusionAppConfig(model=DiffusionModelConfig(name="flux", preset="flux-tiny", device="cpu"),
                                controlnets=[ControlNetConfig(name="edges", preset=None, path=tmp_path / "edges")])
    with pytest.raises(ValueError, match=rf"controlnets\[0\] \('edges', .*edges\) is a ControlNet for the {family} "
                                         r"family, and model 'flux' is flux"):
        LocalBackend.from_config(config)


@pytest.mark.parametrize("mask", [False, True], ids=["img2img", "inpaint"])
def test_edits_equal_diffusers_flux_edit_pipelines(mask):
    source = shape_image("disk")
    kept = np.zeros(source.shape[:2], dtype=np.uint8)
    kept[16:48, 16:48] = 255
    params = _params(edit=EditImage(source, kept if mask else None, strength=0.7), num_inference_steps=4)
    ours = denoise_together(_engine(), [(params, [])])[0]
    pipeline_cls = FluxInpaintPipeline if mask else FluxImg2ImgPipeline
    pipe = pipeline_cls(**build_preset("flux-tiny").as_pipeline().components)
    assert np.abs(ours - _reference(pipe, params)).max() <= TOLERANCE


@pytest.mark.parametrize("preset", ["flux-tiny", "flux-schnell-tiny"])
def test_a_local_flux_directory_loads_as_the_model_saved_there(tmp_path, preset):
    build_preset(preset).as_pipeline().save_pretrained(tmp_path / "flux", safe_serialization=True)
    components = load_local(tmp_path / "flux")
    assert isinstance(components.as_pipeline(), FluxPipeline) and components.family == "flux"
    assert components.default_size == 128 * components.vae_scale_factor  # diffusers' default_sample_size
    assert components.denoiser.config.guidance_embeds == (preset == "flux-tiny")
    params = _params()
    ours = denoise_together(_engine(components), [(params, [])])[0]
    expected = denoise_together(_engine(build_preset(preset)), [(params, [])])[0]
    # The same weights: equal but for the summation order of its threads.
    assert np.abs(ours - expected).max() <= 1e-5


def test_the_images_api_serves_flux_with_true_cfg():
    engine = DiffusionEngine.from_config(DiffusionModelConfig(name="flux-tiny", preset="flux-tiny", device="cpu"))
    config = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=2, guidance_scale=3.5))
    body = {"prompt": "a red circle", "size": "48x64", "seed": 3, "negative_prompt": "blue", "true_cfg_scale": 2.0}
    with images_client(engine, config) as client:
        response = client.post("/v1/images/generations", json=body)
        assert response.status_code == 200, response.text
        assert [(card["id"], card["family"], card["size"]) for card in client.get("/v1/models").json()["data"]] == [
            ("flux-tiny", "flux", "64x64")]
    png = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    params = _params(prompt="a red circle", width=48, height=64, negative_prompt="blue", true_cfg_scale=2.0)
    expected = _reference(build_preset("flux-tiny").as_pipeline(), params)[0]
    assert np.abs(np.asarray(png) / 255.0 - expected).max() <= 1 / 255 + TOLERANCE  # PNG rounding
