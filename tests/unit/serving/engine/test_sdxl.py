"""The engine on an SDXL model (``sdxl-tiny``) against diffusers' StableDiffusionXLPipeline: two text encoders, the
pooled embedding and size ids as the UNet's added inputs, rows of several requests in one forward, parallel CFG."""

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
from serving.engine.unet_split import SplitUNet
from serving.lora.format import LoRAFormatError, LoRATargets, load_lora_file
from serving.presets import build_preset
from tests.helpers.denoising import denoise_together, loaded_lora
from tests.helpers.images_api import images_client
from tests.helpers.lora_files import write_lora

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale


def _engine(**kwargs) -> DiffusionEngine:
    return DiffusionEngine("sdxl-tiny", build_preset("sdxl-tiny"), CPU, **kwargs)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=2,
                  guidance_scale=5.0, seed=3)
    return GenerationParams(**{**values, **overrides})


def _diffusers(params: GenerationParams) -> np.ndarray:
    pipe = build_preset("sdxl-tiny").as_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=params.prompt, negative_prompt=params.negative_prompt, num_images_per_prompt=params.n,
                width=params.width, height=params.height, num_inference_steps=params.num_inference_steps,
                guidance_scale=params.guidance_scale, output_type="np",
                generator=[torch.Generator().manual_seed(params.seed + i) for i in range(params.n)]).images


@pytest.mark.parametrize("overrides", [
    {},  # CFG against zeros: no negative prompt, diffusers' force_zeros_for_empty_prompt
    {"negative_prompt": "a blue square", "n": 2},
    {"guidance_scale": 1.0},  # no CFG: one row per image
    {"width": 48, "height": 80},  # the size ids follow the requested size
], ids=["zero-negative", "negative-n2", "no-cfg", "48x80"])
def test_sdxl_images_equal_diffusers_sdxl_pipeline(overrides):
    params = _params(**overrides)
    ours = denoise_together(_engine(), [(params, [])])[0]
    assert ours.shape == (params.n, params.height, params.width, 3)
    assert np.abs(ours - _diffusers(params)).max() <= TOLERANCE


def test_sdxl_requests_stepped_in_one_forward_equal_each_alone():
    """Each row keeps its own pooled embedding and size ids when requests share a forward."""
    engine = _engine()
    requests = [_params(seed=1), _params(seed=2, prompt="green triangles", negative_prompt="red", n=2),
                _params(seed=3, guidance_scale=1.0)]
    together = denoise_together(engine, [(params, []) for params in requests])
    for params, image in zip(requests, together, strict=True):
        np.testing.assert_allclose(image, denoise_together(engine, [(params, [])])[0], atol=1e-5)
    assert np.abs(together[0] - together[1][:1]).max() > 0.01  # the rows did not share one request's conditioning


def test_the_split_forward_equals_the_sdxl_unet_forward():
    unet = build_preset("sdxl-tiny").unet
    sample, timestep, context = torch.randn(2, 4, 32, 32), torch.tensor([10, 500]), torch.randn(2, 77, 64)
    added = {"text_embeds": torch.randn(2, 32), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64],
                                                                         [64.0, 48, 0, 0, 64, 48]])}
    split = SplitUNet(unet)
    with torch.inference_mode():
        whole = unet(sample, timestep, encoder_hidden_states=context, added_cond_kwargs=added).sample
        halves = split.up(split.down(sample, timestep, context, added))
        without_added = split.up(split.down(sample, timestep, context, {**added, "text_embeds": added[
            "text_embeds"] * 0}))
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-5)
    assert (without_added - whole).abs().max() > 1e-3  # the added embedding reaches the output


def test_parallel_cfg_on_a_local_worker_gives_the_images_of_one_sdxl_engine():
    requests = [(_params(seed=1), []), (_params(seed=2, negative_prompt="blue", n=2), [])]
    worker = LocalCFGWorker(_engine())
    try:
        split = denoise_together(_engine(cfg_worker=worker), requests)
    finally:
        worker.close()
    for image, alone in zip(split, denoise_together(_engine(), requests), strict=True):
        assert np.abs(image - alone).max() <= TOLERANCE


def test_in_float16_the_sdxl_vae_is_kept_in_float32_as_diffusers_upcasts_it():
    engine = DiffusionEngine("sdxl-tiny", build_preset("sdxl-tiny"), CPU, torch.float16)
    assert engine.vae_dtype == torch.float32 and next(engine.vae.parameters()).dtype == torch.float32
    assert next(engine.unet.parameters()).dtype == torch.float16
    assert next(engine.prompts.text_encoder_2.parameters()).dtype == torch.float16
    sd = DiffusionEngine("tiny", build_preset("tiny"), CPU, torch.float16)
    assert next(sd.vae.parameters()).dtype == torch.float16  # diffusers' SD pipeline decodes in the model's dtype


def test_the_images_api_serves_an_sdxl_preset_configured_by_name():
    engine = DiffusionEngine.from_config(DiffusionModelConfig(name="sdxl-tiny", preset="sdxl-tiny", device="cpu"))
    config = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=2))
    with images_client(engine, config) as client:
        response = client.post("/v1/images/generations", json={"prompt": "a red circle", "size": "48x64", "seed": 3,
                                                               "guidance_scale": 5.0})
        assert response.status_code == 200, response.text
        assert [(card["id"], card["family"], card["size"]) for card in client.get("/v1/models").json()["data"]] == [
            ("sdxl-tiny", "sdxl", "64x64")]
    png = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    expected = _diffusers(_params(prompt="a red circle", width=48, height=64, seed=3))[0]
    assert png.size == (48, 64)
    assert np.abs(np.asarray(png) / 255.0 - expected).max() <= 1 / 255 + TOLERANCE  # PNG rounding


def _diffusers_with_lora(params: GenerationParams, path, scale: float) -> np.ndarray:
    """The same request through diffusers' SDXL pipeline, the LoRA loaded with load_lora_weights and fused."""
    pipe = build_preset("sdxl-tiny").as_pipeline()
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(load_file(path))
    pipe.fuse_lora(components=["unet", "text_encoder", "text_encoder_2"], lora_scale=scale)
    return pipe(prompt=params.prompt, negative_prompt=params.negative_prompt, width=params.width,
                height=params.height, num_inference_steps=params.num_inference_steps,
                guidance_scale=params.guidance_scale, output_type="np",
                generator=[torch.Generator().manual_seed(params.seed)]).images


def test_an_sdxl_lora_on_the_unet_and_both_text_encoders_equals_diffusers_fused(tmp_path):
    path = write_lora(tmp_path / "style.safetensors", seed=5, text_encoder=True, preset="sdxl-tiny")
    engine = _engine()
    lora = loaded_lora(engine, path, 0.7)
    weights = lora.load.result()
    assert weights.unet and weights.text_encoder and weights.text_encoder_2
    params = _params(negative_prompt="blue")
    ours = denoise_together(engine, [(params, [lora])])[0]
    assert np.abs(ours - _diffusers_with_lora(params, path, 0.7)).max() <= TOLERANCE
    assert np.abs(ours - denoise_together(engine, [(params, [])])[0]).max() > 20 * TOLERANCE


def test_an_sdxl_lora_is_refused_by_a_model_with_one_text_encoder(tmp_path):
    path = write_lora(tmp_path / "xl.safetensors", seed=5, text_encoder=True, preset="sdxl-tiny")
    tiny = build_preset("tiny")
    with pytest.raises(LoRAFormatError, match="a LoRA for the sdxl family, and this model has one text encoder"):
        load_lora_file(path, LoRATargets.from_modules(tiny.unet, tiny.text_encoder), max_file_bytes=2**30)


def test_an_sd_lora_on_an_sdxl_model_is_refused_naming_the_family_it_may_need(tmp_path):
    path = write_lora(tmp_path / "sd.safetensors", seed=5, text_encoder=True, preset="tiny")
    sdxl = build_preset("sdxl-tiny")
    targets = LoRATargets.from_modules(sdxl.unet, sdxl.text_encoder, sdxl.text_encoder_2)
    with pytest.raises(LoRAFormatError, match="it does not fit this sdxl model: a LoRA for the sd family"):
        load_lora_file(path, targets, max_file_bytes=2**30)
