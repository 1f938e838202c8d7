"""Edits: img2img and inpainting (a 4-channel denoiser) against diffusers' img2img and inpainting pipelines of each
family, built from the same components, with the same scheduler and generators; edits and text-to-image requests
in one denoiser forward; what inpainting keeps; the 400s of an edit the engine cannot make."""

import dataclasses

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    HeunDiscreteScheduler,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    UNet2DConditionModel,
)

from serving.common.errors import APIError
from serving.engine import DiffusionEngine, EditImage, GenerationParams
from serving.engine.types import ControlNetSpec
from serving.presets import DiffusionComponents, build_preset
from tests.helpers.denoising import denoise_together, pipeline_images

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale
#: Schedulers named here, as diffusers is given them (``from_config`` of the pipeline's own); None: the model's own
SCHEDULERS = {"ddim": DDIMScheduler, "euler_a": EulerAncestralDiscreteScheduler, "heun": HeunDiscreteScheduler,
              "dpmpp_2m": DPMSolverMultistepScheduler}
PIPELINES = {"tiny": (StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline),
             "sdxl-tiny": (StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline),
             "sd3-tiny": (StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline)}
KEPT_COLUMNS = 4  # of the 8 latent columns: the mask keeps image columns 0-31


def _source() -> np.ndarray:
    """A 64x64 RGB image: colour gradients with a dark disc."""
    y, x = np.mgrid[0:64, 0:64]
    image = np.stack([x * 4, y * 4, 255 - x * 2], axis=-1)
    image[(x - 20) ** 2 + (y - 36) ** 2 < 144] = (30, 20, 90)
    return image.astype(np.uint8)


def _mask() -> np.ndarray:
    """Repaint the right half, with grey columns the mask processor binarises at one half (127: keep, 128: repaint)
    where resizing to the latent grid samples them."""
    mask = np.zeros((64, 64), np.uint8)
    mask[:, 32:] = 255
    mask[:, 24], mask[:, 32] = 127, 128
    return mask


@pytest.fixture(scope="module")
def engines() -> dict[str, DiffusionEngine]:
    return {preset: DiffusionEngine(preset, build_preset(preset), CPU) for preset in PIPELINES}


def _params(strength: float = 0.6, mask: np.ndarray | None = None, **overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=4,
                  guidance_scale=5.0, seed=3, n=2, edit=EditImage(_source(), mask, strength))
    return GenerationParams(**{**values, **overrides})


def _diffusers(preset: str, params: GenerationParams, output_type: str = "np") -> np.ndarray:
    """The edit through the preset's diffusers img2img or inpainting pipeline (from the same components)."""
    assert params.edit is not None
    image_to_image, inpaint = PIPELINES[preset]
    pipeline_cls = inpaint if params.edit.mask is not None else image_to_image
    pipe = pipeline_cls(**build_preset(preset).as_pipeline().components)
    if params.scheduler is not None:
        pipe.scheduler = SCHEDULERS[params.scheduler].from_config(pipe.scheduler.config)
    return pipeline_images(pipe, params, output_type=output_type)


@pytest.mark.parametrize(("preset", "scheduler", "strength", "n"), [
    ("tiny", None, 0.6, 2), ("tiny", "euler_a", 0.8, 2), ("tiny", "heun", 0.6, 1), ("tiny", None, 1.0, 1),
    ("sdxl-tiny", "euler_a", 0.6, 2), ("sdxl-tiny", None, 0.5, 1),
    # diffusers' SD3 img2img encodes only its first image with a list of generators (n > 1 fails there)
    ("sd3-tiny", None, 0.6, 1),
])
def test_img2img_equals_the_diffusers_img2img_pipeline(engines, preset, scheduler, strength, n):
    params = _params(strength, scheduler=scheduler, n=n)
    ours = denoise_together(engines[preset], [(params, [])])[0]
    assert np.abs(ours - _diffusers(preset, params)).max() <= TOLERANCE


@pytest.mark.parametrize(("preset", "scheduler", "strength", "n"), [
    ("tiny", None, 1.0, 2), ("tiny", "euler_a", 0.6, 2), ("tiny", "dpmpp_2m", 0.75, 1), ("tiny", "heun", 1.0, 1),
    ("sdxl-tiny", None, 1.0, 2), ("sdxl-tiny", "euler_a", 0.6, 1),
])
def test_inpainting_equals_the_diffusers_inpainting_pipeline(engines, preset, scheduler, strength, n):
    """Ancestral sampling draws from the generators after the image encodings: their draws match too."""
    params = _params(strength, _mask(), scheduler=scheduler, n=n)
    ours = denoise_together(engines[preset], [(params, [])])[0]
    assert np.abs(ours - _diffusers(preset, params)).max() <= TOLERANCE


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_sd3_inpainting_equals_the_diffusers_sd3_inpainting_latents(engines, strength):
    """Compared before decoding: diffusers' SD3 inpainting pipeline decodes without the VAE's shift factor (its
    text-to-image and img2img pipelines, and the engine, add it)."""
    engine, params = engines["sd3-tiny"], _params(strength, _mask())
    state = engine.start(params)
    while not state.done:
        engine.step([state])
    reference = _diffusers("sd3-tiny", params, output_type="latent")
    torch.testing.assert_close(state.latents, reference, atol=1e-4, rtol=0)


def test_edits_and_text_to_image_share_forwards_each_as_alone(engines):
    engine = engines["tiny"]
    requests = [_params(edit=None), _params(0.5, scheduler="euler_a", seed=5, n=1),
                _params(1.0, _mask(), seed=7), _params(0.6, _mask(), scheduler="heun", n=1)]
    together = denoise_together(engine, [(params, []) for params in requests])
    for ours, params in zip(together, requests, strict=True):
        assert np.abs(ours - denoise_together(engine, [(params, [])])[0]).max() <= TOLERANCE
    assert np.abs(together[0][0] - together[2][0]).max() > 20 * TOLERANCE  # the edit visibly differs


def test_inpainting_keeps_the_unmasked_latents_and_repaints_the_masked_ones(engines):
    engine = engines["tiny"]
    state = engine.start(_params(1.0, _mask(), n=1))
    assert state.inpainting is not None
    source = state.inpainting.image_latents
    engine.step([state])
    assert state.x0_estimate is not None  # a preview shows the kept region as it is
    assert torch.equal(state.x0_estimate[..., :KEPT_COLUMNS], source[..., :KEPT_COLUMNS])
    while not state.done:
        engine.step([state])
    assert torch.equal(state.latents[..., :KEPT_COLUMNS], source[..., :KEPT_COLUMNS])
    assert (state.latents[..., KEPT_COLUMNS:] - source[..., KEPT_COLUMNS:]).abs().mean() > 0.3
    image = engine.decode(state)[0]
    round_trip = engine.vae.decode(source / engine.vae.config.scaling_factor).sample
    round_trip = (round_trip / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)[0].numpy()
    kept, repainted = (np.abs(image - round_trip)[:, columns].mean() for columns in (slice(0, 24), slice(40, 64)))
    assert kept < repainted / 1.5  # the tiny VAE decoder's attention sees the whole image: closer, not equal


@pytest.mark.parametrize(("preset", "field", "edit", "message"), [
    ("tiny", "strength", EditImage(_source(), strength=0.2), "no denoising step"),  # int(4 * 0.2) == 0
    ("tiny", "strength", EditImage(_source(), strength=0.0), "(0, 1]"),
    ("tiny", "image", EditImage(_source()[:32]), "64x64"),
    ("tiny", "mask", EditImage(_source(), _mask()[:, :32]), "64x64"),
    ("sd3-tiny", "scheduler", None, "euler"),
])
def test_an_edit_the_engine_cannot_make_is_a_400_naming_the_field(engines, preset, field, edit, message):
    params = _params(scheduler="dpmpp_2m") if edit is None else _params(edit=edit)  # SD3: edits need scale_noise
    with pytest.raises(APIError) as refused:
        engines[preset].validate(params)
    error = refused.value
    assert (error.status_code, error.param, error.code) == (400, field, "invalid_value")
    assert message in error.message


def test_an_edit_runs_the_steps_its_strength_leaves_as_each_family_counts_them(engines):
    """SD and SDXL run ``int(steps * strength)`` steps, SD3 ``steps - int(steps - steps * strength)``."""
    assert len(engines["tiny"].start(_params(0.6, n=1)).timesteps) == 2
    heun = engines["tiny"].start(_params(0.6, n=1, scheduler="heun"))
    assert len(heun.timesteps) == 2 * 2 - 1  # two model evaluations a step but the first
    assert len(engines["sd3-tiny"].start(_params(0.2, n=1)).timesteps) == 1


@pytest.fixture(scope="module")
def inpainting_components() -> DiffusionComponents:
    """The tiny preset with a seeded inpainting UNet: 9 input channels (latents, mask, masked-image latents)."""
    components = build_preset("tiny")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        unet = UNet2DConditionModel.from_config(components.denoiser.config, in_channels=9)
    return dataclasses.replace(components, denoiser=unet).freeze()


@pytest.mark.parametrize(("scheduler", "strength", "n", "guidance"), [
    (None, 1.0, 2, 5.0), ("euler_a", 0.6, 2, 5.0), ("ddim", 0.75, 1, 1.0),
])
def test_an_inpainting_model_equals_the_diffusers_inpainting_pipeline(inpainting_components, scheduler, strength, n,
                                                                       guidance):
    """With and without CFG; beside a 4-channel request's rows nothing is shared, so alone."""
    engine = DiffusionEngine("inpainting", inpainting_components, CPU)
    params = _params(strength, _mask(), scheduler=scheduler, n=n, guidance_scale=guidance)
    ours = denoise_together(engine, [(params, [])])[0]
    pipe = StableDiffusionInpaintPipeline(**inpainting_components.as_pipeline().components)
    if scheduler is not None:
        pipe.scheduler = SCHEDULERS[scheduler].from_config(pipe.scheduler.config)
    assert np.abs(ours - pipeline_images(pipe, params)).max() <= TOLERANCE
    both = denoise_together(engine, [(params, []), (_params(1.0, _mask(), seed=9), [])])
    assert np.abs(both[0] - ours).max() <= TOLERANCE  # two inpainting requests share its forwards


@pytest.mark.parametrize(("params", "field"), [
    (_params(edit=None), "image"), (_params(), "mask"), (_params(1.0, _mask(), controlnets=(ControlNetSpec(
        "edges", _source()),)), "controlnets"),
])
def test_an_inpainting_model_refuses_what_is_not_inpainting_with_a_400(inpainting_components, params, field):
    with pytest.raises(APIError) as refused:
        DiffusionEngine("inpainting", inpainting_components, CPU).validate(params)
    assert (refused.value.status_code, refused.value.param) == (400, field)
