"""The preview decoders (a fitted linear latent->RGB map, the full VAE) and the steps previews are taken after."""

import numpy as np
import pytest
import torch

from serving.config import DiffusionModelConfig
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.preview import LatentRGBPreview, VAEPreview, fit_images, preview_decoder, preview_steps

PROMPTS = ("a red circle on a white background", "a blue square on a dark background", "a green triangle",
           "an outlined yellow star on a white background")
#: Measured on the trained tiny preset (4 prompts x 2 seeds, 8 steps): the map's mean abs error against the VAE
#: decode is 0.12-0.21 per image (0.15 overall); a flat grey image is 0.43 off overall.
MAX_MEAN_ERROR = 0.25


@pytest.fixture(scope="module")
def trained_engine() -> DiffusionEngine:
    """The tiny preset with its shipped trained weights: its denoised latents decode to real pictures (with the
    seeded weights they decode to near-uniform grey, which says nothing about a preview)."""
    return DiffusionEngine.from_config(DiffusionModelConfig(preset="tiny", weights="auto", device="cpu"))


def _denoised(engine: DiffusionEngine, params: list[GenerationParams]) -> torch.Tensor:
    """The final latents of every request, denoised in one batch."""
    states = [engine.start(request) for request in params]
    while not states[0].done:
        engine.step(states)
    return torch.cat([state.latents for state in states])


@pytest.mark.parametrize(("steps", "partial_images", "expected"), [
    (4, 0, []), (4, 1, [2]), (4, 2, [1, 3]), (4, 3, [1, 2, 3]), (10, 3, [3, 5, 8]), (3, 2, [1, 2]),
    (2, 3, [1]),  # too few steps for three distinct previews before the last
    (1, 3, []),  # a single step: the result is the only image
])
def test_previews_are_evenly_spaced_distinct_steps_before_the_last(steps, partial_images, expected):
    assert preview_steps(steps, partial_images) == expected


def test_the_fit_images_are_deterministic_and_span_the_colour_range():
    images = fit_images(32)
    assert images.shape == (24, 3, 32, 32) and images.dtype == np.float32
    assert np.array_equal(images, fit_images(32))
    assert images.min() == 0.0 and images.max() == 1.0
    assert len({tuple(image.mean(axis=(1, 2)).round(3)) for image in images}) == len(images)  # no two alike


def test_approximate_preview_of_denoised_latents_is_close_to_the_vae_decode(trained_engine):
    engine = trained_engine
    approx = preview_decoder("approx", engine.vae, engine.vae_scale_factor, engine.vae_dtype)
    assert isinstance(approx, LatentRGBPreview) and approx.weights.shape == (5, 3)  # 4 latent channels + bias
    requests = [GenerationParams(prompt=prompt, width=64, height=64, num_inference_steps=8, guidance_scale=7.5,
                                 seed=seed) for prompt in PROMPTS for seed in (0, 1)]
    latents = _denoised(engine, requests)
    exact = VAEPreview(engine.vae, engine.vae_dtype).decode(latents, 64, 64)
    preview = approx.decode(latents, 64, 64)
    assert preview.shape == exact.shape == (8, 64, 64, 3)
    assert preview.min() >= 0.0 and preview.max() <= 1.0
    error = np.abs(preview - exact).mean()
    grey_error = np.abs(0.5 - exact).mean()
    assert error <= MAX_MEAN_ERROR
    assert error <= 0.5 * grey_error  # far better than showing nothing


def test_vae_preview_is_the_engines_own_decode(trained_engine):
    engine = trained_engine
    state = engine.start(GenerationParams(prompt=PROMPTS[0], width=64, height=64, num_inference_steps=2,
                                          guidance_scale=7.5, seed=3, n=2))
    while not state.done:
        engine.step([state])
    vae = preview_decoder("vae", engine.vae, engine.vae_scale_factor, engine.vae_dtype)
    assert np.array_equal(vae.decode(state.latents, 64, 64), engine.decode(state))


def test_the_map_upsamples_to_the_requested_size():
    weights = torch.zeros(5, 3)
    weights[0] = torch.tensor([1.0, 0.0, 0.0])  # channel 0 is red
    weights[4] = torch.tensor([0.0, 0.0, 0.25])  # a blue bias
    latents = torch.zeros(1, 4, 2, 3)
    latents[0, 0, :, 0] = 2.0  # the left column: red beyond 1, clamped
    preview = LatentRGBPreview(weights).decode(latents, 8, 12)
    assert preview.shape == (1, 8, 12, 3)
    assert np.allclose(preview[0, :, 0], [1.0, 0.0, 0.25]) and np.allclose(preview[0, :, -1], [0.0, 0.0, 0.25])
