"""Writing LoRA files for tests, the way diffusers' own tests make them (PEFT adapters, non-zero init), and
hand-built safetensors files whose headers say anything."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from diffusers import StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from serving.presets import build_preset

#: attention projections: a UNet's transformer blocks and SD3's MMDiT blocks name them alike
DENOISER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
#: the family's pipeline (whose ``save_lora_weights`` writes the file) and its denoiser's name in that file
_SAVERS = {"sd": (StableDiffusionPipeline, "unet"), "sdxl": (StableDiffusionXLPipeline, "unet"),
           "sd3": (StableDiffusion3Pipeline, "transformer")}


def write_lora(path: Path, *, seed: int, rank: int = 4, alpha: float | None = None, text_encoder: bool = False,
               denoiser_targets: list[str] = DENOISER_TARGETS, preset: str = "tiny") -> Path:
    """A diffusers-format LoRA for ``preset`` at ``path`` (``.safetensors``), random non-zero weights, on the
    denoiser (``unet.`` keys; SD3: ``transformer.``); with ``text_encoder``, on every CLIP text encoder of the preset
    (SDXL's and SD3's two; not SD3's T5, as in diffusers). Key names as diffusers' training scripts save them:
    diffusers' older ones (``lora.down``) for SD and SDXL, PEFT's (``lora_A``) for SD3."""
    components = build_preset(preset)
    encoders = [components.text_encoder] + ([components.text_encoder_2] if components.text_encoder_2 else [])
    pipeline, denoiser = _SAVERS[components.family]
    keys = (lambda state: state) if components.family == "sd3" else convert_state_dict_to_diffusers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components.denoiser.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=denoiser_targets,
                                                   init_lora_weights=False))
        layers = {f"{denoiser}_lora_layers": keys(get_peft_model_state_dict(components.denoiser))}
        for index, encoder in enumerate(encoders if text_encoder else []):
            encoder.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=TEXT_TARGETS,
                                           init_lora_weights=False))
            name = "text_encoder_lora_layers" if index == 0 else "text_encoder_2_lora_layers"
            layers[name] = keys(get_peft_model_state_dict(encoder))
    pipeline.save_lora_weights(path.parent, weight_name=path.name, **layers)
    return path


def safetensors_bytes(header: dict | bytes, data: bytes = b"", *, header_length: int | None = None) -> bytes:
    """A safetensors file built by hand: ``header`` (a dict is written as JSON) and ``data`` after it, the header's
    length declared as ``header_length`` when given (a lie), else its true length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_length is None else header_length) + raw + data
