"""SDXL-specific paths (``sdxl-tiny``): the split UNet with the added embedding, the float32 VAE under float16, LoRAs
of the wrong family. Equality with diffusers' StableDiffusionXLPipeline (plain, LoRAs, batching, parallel CFG, the
images API): test_families.py."""


import pytest
import torch

from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.unet_split import SplitUNet
from serving.lora.format import LoRAFormatError, LoRATargets, load_lora_file
from serving.presets import build_preset
from tests.helpers.lora_files import write_lora

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale


def _engine(**kwargs) -> DiffusionEngine:
    return DiffusionEngine("sdxl-tiny", build_preset("sdxl-tiny"), CPU, **kwargs)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=2,
                  guidance_scale=5.0, seed=3)
    return GenerationParams(**{**values, **overrides})


def test_the_split_forward_equals_the_sdxl_unet_forward():
    unet = build_preset("sdxl-tiny").denoiser
    sample, timestep, context = torch.randn(2, 4, 32, 32), torch.tensor([10, 500]), torch.randn(2, 77, 80)
    added = {"text_embeds": torch.randn(2, 48), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64],
                                                                         [64.0, 48, 0, 0, 64, 48]])}
    split = SplitUNet(unet)
    with torch.inference_mode():
        whole = unet(sample, timestep, encoder_hidden_states=context, added_cond_kwargs=added).sample
        halves = split.up(split.down(sample, timestep, context, added))
        without_added = split.up(split.down(sample, timestep, context, {**added, "text_embeds": added[
            "text_embeds"] * 0}))
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-5)
    assert (without_added - whole).abs().max() > 1e-3  # the added embedding reaches the output


def test_in_float16_the_sdxl_vae_is_kept_in_float32_as_diffusers_upcasts_it():
    engine = DiffusionEngine("sdxl-tiny", build_preset("sdxl-tiny"), CPU, torch.float16)
    assert engine.vae_dtype == torch.float32 and next(engine.vae.parameters()).dtype == torch.float32
    assert next(engine.denoiser.module.parameters()).dtype == torch.float16
    assert next(engine.prompts.text_encoder_2.parameters()).dtype == torch.float16
    sd = DiffusionEngine("tiny", build_preset("tiny"), CPU, torch.float16)
    assert next(sd.vae.parameters()).dtype == torch.float16  # diffusers' SD pipeline decodes in the model's dtype


def test_an_sdxl_lora_is_refused_by_a_model_with_one_text_encoder(tmp_path):
    path = write_lora(tmp_path / "xl.safetensors", seed=5, text_encoder=True, preset="sdxl-tiny")
    tiny = build_preset("tiny")
    with pytest.raises(LoRAFormatError, match="a LoRA for the sdxl family, and this model has one text encoder"):
        load_lora_file(path, LoRATargets.from_modules(tiny.denoiser, tiny.text_encoder), max_file_bytes=2**30)


def test_an_sd_lora_on_an_sdxl_model_is_refused_naming_the_family_it_may_need(tmp_path):
    path = write_lora(tmp_path / "sd.safetensors", seed=5, text_encoder=True, preset="tiny")
    sdxl = build_preset("sdxl-tiny")
    targets = LoRATargets.from_modules(sdxl.denoiser, sdxl.text_encoder, sdxl.text_encoder_2)
    with pytest.raises(LoRAFormatError, match="it does not fit this sdxl model: a LoRA for the sd family"):
        load_lora_file(path, targets, max_file_bytes=2**30)
