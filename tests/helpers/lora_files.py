"""Writing LoRA files for tests, the way diffusers' own tests make them (PEFT adapters, non-zero init), and
hand-built safetensors files whose headers say anything."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from serving.presets import build_preset

#: attention projections: a UNet's transformer blocks and SD3's and Flux's transformer blocks name them alike
DENOISER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
#: the family's pipeline (whose ``save_lora_weights`` writes the file) and its denoiser's name in that file
_SAVERS = {"sd": (StableDiffusionPipeline, "unet"), "sdxl": (StableDiffusionXLPipeline, "unet"),
           "sd3": (StableDiffusion3Pipeline, "transformer"), "flux": (FluxPipeline, "transformer")}


def write_lora(path: Path, *, seed: int, rank: int = 4, alpha: float | None = None, text_encoder: bool = False,
               denoiser_targets: list[str] = DENOISER_TARGETS, preset: str = "tiny") -> Path:
    """A diffusers-format LoRA for ``preset`` at ``path`` (``.safetensors``), random non-zero weights, on the
    denoiser (``unet.`` keys; SD3: ``transformer.``); with ``text_encoder``, on every CLIP text encoder of the preset
    (SDXL's and SD3's two, Flux's one; never a T5, as in diffusers). Key names as diffusers' training scripts save
    them: diffusers' older ones (``lora.down``) for SD and SDXL, PEFT's (``lora_A``) for SD3 and Flux."""
    components = build_preset(preset)
    encoders = [components.text_encoder] + ([components.text_encoder_2] if components.text_encoder_2 else [])
    pipeline, denoiser = _SAVERS[components.family]
    keys = (lambda state: state) if components.family in ("sd3", "flux") else convert_state_dict_to_diffusers
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


def write_flux_lora(path: Path, *, seed: int, style: str, rank: int = 4, alpha: float = 2.0,
                    text_encoder: bool = False) -> Path:
    """A ``flux-tiny`` LoRA in a trainer's own layout, random non-zero weights, on the double-stream block's
    attention (its fused qkv and output projections, image and text streams) and image MLP: ``kohya`` (sd-scripts:
    ``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``, an ``.alpha`` per module; with ``text_encoder``,
    ``lora_te1_`` keys on the CLIP encoder's attention) or ``xlabs``
    (``double_blocks.0.processor.qkv_lora1.down.weight``, no alphas). What diffusers' ``FluxPipeline.lora_state_dict``
    converts."""

    config = build_preset("flux-tiny").denoiser.config
    width = config.num_attention_heads * config.attention_head_dim
    generator = torch.Generator().manual_seed(seed)

    def factors(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rank, in_features, generator=generator) * 0.3,
                torch.randn(out_features, rank, generator=generator) * 0.3)

    tensors: dict[str, torch.Tensor] = {}
    if style == "kohya":
        modules = {"img_attn_qkv": (3 * width, width), "img_attn_proj": (width, width),
                   "txt_attn_qkv": (3 * width, width), "txt_attn_proj": (width, width),
                   "img_mlp_0": (4 * width, width)}
        for module, (out_features, in_features) in modules.items():
            down, up = factors(out_features, in_features)
            key = f"lora_unet_double_blocks_0_{module}"
            tensors |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                        f"{key}.alpha": torch.tensor(alpha)}
        if text_encoder:
            hidden = build_preset("flux-tiny").text_encoder.config.hidden_size
            for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
                down, up = factors(hidden, hidden)
                key = f"lora_te1_text_model_encoder_layers_0_self_attn_{projection}"
                tensors |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                            f"{key}.alpha": torch.tensor(alpha)}
    elif style == "xlabs":
        modules = {"qkv_lora1": (3 * width, width), "proj_lora1": (width, width), "qkv_lora2": (3 * width, width),
                   "proj_lora2": (width, width)}
        for module, (out_features, in_features) in modules.items():
            down, up = factors(out_features, in_features)
            key = f"double_blocks.0.processor.{module}"
            tensors |= {f"{key}.down.weight": down, f"{key}.up.weight": up}
    else:
        raise ValueError(f"unknown style {style!r}")
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(path))
    return path


def safetensors_bytes(header: dict | bytes, data: bytes = b"", *, header_length: int | None = None) -> bytes:
    """A safetensors file built by hand: ``header`` (a dict is written as JSON) and ``data`` after it, the header's
    length declared as ``header_length`` when given (a lie), else its true length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_length is None else header_length) + raw + data
