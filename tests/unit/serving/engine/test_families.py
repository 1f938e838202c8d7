"""The engine on each model family beyond SD 1.x against the family's own diffusers pipeline, same components and
seeds: SDXL (``sdxl-tiny``: two CLIP encoders, pooled embedding and size ids as the UNet's added inputs) and SD3
(``sd3-tiny``: an MMDiT transformer, two CLIP encoders and a T5 encoder, flow matching). Rows of several requests in
one forward, per-request LoRAs, parallel CFG, the images API. Family-specific paths: test_sdxl.py, test_sd3.py."""

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from serving.config import DiffusionAppConfig, DiffusionModelConfig, GenerationDefaults
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.cfg import LocalCFGWorker
from serving.presets import build_preset
from tests.helpers.denoising import denoise_together, loaded_lora, pipeline_images
from tests.helpers.images_api import images_client
from tests.helpers.lora_files import write_lora

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale
#: preset -> its family and the diffusers name of its denoiser (what ``fuse_lora`` calls it)
FAMILIES = {"sdxl-tiny": ("sdxl", "unet"), "sd3-tiny": ("sd3", "transformer")}
PRESETS = list(FAMILIES)


def _engine(preset: str, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(preset, build_preset(preset), CPU, **kwargs)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=2,
                  guidance_scale=5.0, seed=3)
    return GenerationParams(**{**values, **overrides})


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("overrides", [
    {},  # CFG without a negative prompt: SDXL conditions on zeros (force_zeros_for_empty_prompt), SD3 on ""
    {"negative_prompt": "a blue square", "n": 2},
    {"guidance_scale": 1.0},  # no CFG: one row per image
    {"width": 48, "height": 80},  # SDXL's size ids follow the requested size; SD3's patches tile it
], ids=["no-negative", "negative-n2", "no-cfg", "48x80"])
def test_images_equal_the_familys_diffusers_pipeline(preset, overrides):
    params = _params(**overrides)
    ours = denoise_together(_engine(preset), [(params, [])])[0]
    assert ours.shape == (params.n, params.height, params.width, 3)
    assert np.abs(ours - pipeline_images(build_preset(preset).as_pipeline(), params)).max() <= TOLERANCE


@pytest.mark.parametrize("preset", PRESETS)
def test_requests_stepped_in_one_forward_equal_each_alone(preset):
    """Each row keeps its own timestep, text conditioning and added inputs when requests share a forward."""
    engine = _engine(preset)
    requests = [_params(seed=1), _params(seed=2, prompt="green triangles", negative_prompt="red", n=2,
                                         num_inference_steps=3),
                _params(seed=3, guidance_scale=1.0)]
    states = [engine.start(params) for params in requests]
    while not all(state.done for state in states):  # the 3-step request has other timesteps
        engine.step([state for state in states if not state.done])
    together = [engine.decode(state) for state in states]
    for params, image in zip(requests, together, strict=True):
        np.testing.assert_allclose(image, denoise_together(engine, [(params, [])])[0], atol=1e-5)
    assert np.abs(together[0] - together[1][:1]).max() > 0.01  # the rows did not share one request's conditioning


@pytest.mark.parametrize("preset", PRESETS)
def test_parallel_cfg_on_a_local_worker_gives_the_images_of_one_engine(preset):
    requests = [(_params(seed=1), []), (_params(seed=2, negative_prompt="blue", n=2), [])]
    worker = LocalCFGWorker(_engine(preset))
    try:
        split = denoise_together(_engine(preset, cfg_worker=worker), requests)
    finally:
        worker.close()
    for image, alone in zip(split, denoise_together(_engine(preset), requests), strict=True):
        assert np.abs(image - alone).max() <= TOLERANCE


@pytest.mark.parametrize("preset", PRESETS)
def test_a_lora_on_the_denoiser_and_both_clip_encoders_equals_diffusers_fused(preset, tmp_path):
    path = write_lora(tmp_path / "style.safetensors", seed=5, text_encoder=True, preset=preset)
    engine = _engine(preset)
    lora = loaded_lora(engine, path, 0.7)
    weights = lora.load.result()
    assert weights.denoiser and weights.text_encoder and weights.text_encoder_2
    params = _params(negative_prompt="blue")
    ours = denoise_together(engine, [(params, [lora])])[0]
    pipe = build_preset(preset).as_pipeline()
    pipe.load_lora_weights(load_file(path))
    pipe.fuse_lora(components=[FAMILIES[preset][1], "text_encoder", "text_encoder_2"], lora_scale=0.7)
    assert np.abs(ours - pipeline_images(pipe, params)).max() <= TOLERANCE
    assert np.abs(ours - denoise_together(engine, [(params, [])])[0]).max() > 20 * TOLERANCE


@pytest.mark.parametrize("preset", PRESETS)
def test_the_images_api_serves_the_preset_configured_by_name(preset):
    engine = DiffusionEngine.from_config(DiffusionModelConfig(name=preset, preset=preset, device="cpu"))
    config = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=2))
    with images_client(engine, config) as client:
        response = client.post("/v1/images/generations", json={"prompt": "a red circle", "size": "48x64", "seed": 3,
                                                               "guidance_scale": 5.0})
        assert response.status_code == 200, response.text
        assert [(card["id"], card["family"], card["size"]) for card in client.get("/v1/models").json()["data"]] == [
            (preset, FAMILIES[preset][0], "64x64")]
    png = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    expected = pipeline_images(build_preset(preset).as_pipeline(),
                               _params(prompt="a red circle", width=48, height=64, seed=3))[0]
    assert png.size == (48, 64)
    assert np.abs(np.asarray(png) / 255.0 - expected).max() <= 1 / 255 + TOLERANCE  # PNG rounding
