"""Writing LoRA files for tests, the way diffusers' own tests make them (PEFT adapters, non-zero init), and
hand-built safetensors files whose headers say anything."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from serving.presets import build_preset

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def write_lora(path: Path, *, seed: int, rank: int = 4, alpha: float | None = None, text_encoder: bool = False,
               unet_targets: list[str] = UNET_TARGETS, preset: str = "tiny") -> Path:
    """A diffusers-format LoRA for ``preset`` at ``path`` (``.safetensors``), random non-zero weights; with
    ``text_encoder``, on every text encoder of the preset (SDXL's two)."""
    components = build_preset(preset)
    encoders = [components.text_encoder] + ([components.text_encoder_2] if components.text_encoder_2 else [])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components.unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=unet_targets,
                                               init_lora_weights=False))
        layers = {"unet_lora_layers": convert_state_dict_to_diffusers(get_peft_model_state_dict(components.unet))}
        for index, encoder in enumerate(encoders if text_encoder else []):
            encoder.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=TEXT_TARGETS,
                                           init_lora_weights=False))
            name = "text_encoder_lora_layers" if index == 0 else "text_encoder_2_lora_layers"
            layers[name] = convert_state_dict_to_diffusers(get_peft_model_state_dict(encoder))
    pipeline = StableDiffusionXLPipeline if components.family == "sdxl" else StableDiffusionPipeline
    pipeline.save_lora_weights(path.parent, weight_name=path.name, **layers)
    return path


def safetensors_bytes(header: dict | bytes, data: bytes = b"", *, header_length: int | None = None) -> bytes:
    """A safetensors file built by hand: ``header`` (a dict is written as JSON) and ``data`` after it, the header's
    length declared as ``header_length`` when given (a lie), else its true length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_length is None else header_length) + raw + data
