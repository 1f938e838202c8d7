"""ControlNet models: seeded presets matching the diffusion presets, or local diffusers directories."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel

from serving.preset_catalog import WeightsChoice, preset_weights
from serving.presets import build_preset

# Conditioning-embedding widths: one stride-2 stage per factor of 2 between image and latent.
_CONDITIONING_CHANNELS = {"tiny": (16, 32, 64), "sd15-shape": (16, 32, 96, 256), "sdxl-tiny": (16, 32),
                          "sdxl-shape": (16, 32, 96, 256)}
CONTROLNET_PRESETS: tuple[str, ...] = tuple(_CONDITIONING_CHANNELS)


def controlnet_preset_weights(name: str) -> Path | None:
    """The shipped trained ControlNet of diffusion preset ``name`` (``tiny``: canny edges), or None."""
    pipeline = preset_weights(name)
    return pipeline / "controlnet" if pipeline is not None and (pipeline / "controlnet" / "config.json").is_file() \
        else None


def build_controlnet_preset(name: str, seed: int = 0, *, weights: WeightsChoice = "seeded", zero_init: bool = False,
                            unet: UNet2DConditionModel | None = None) -> ControlNetModel:
    """A ControlNet for diffusion preset ``name``. ``auto`` weights: the preset's shipped trained ControlNet
    where it has one. Otherwise seeded: its encoder copied from ``unet`` (default: the preset's seeded UNet), as
    ControlNet training starts; zero-convolutions stay zero with ``zero_init`` (the start of training), else
    they are drawn non-zero from ``seed`` so the residuals matter."""
    if name not in _CONDITIONING_CHANNELS:
        raise ValueError(f"unknown ControlNet preset {name!r}; known presets: {', '.join(CONTROLNET_PRESETS)}")
    trained = controlnet_preset_weights(name) if weights == "auto" else None
    if trained is not None:
        return load_controlnet(trained)
    unet = unet if unet is not None else build_preset(name, weights="seeded").unet
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        controlnet = ControlNetModel.from_unet(
            unet, conditioning_embedding_out_channels=_CONDITIONING_CHANNELS[name])
        if zero_init:
            return controlnet
        zero_convs = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                      controlnet.controlnet_cond_embedding.conv_out]
        for conv in zero_convs:
            torch.nn.init.normal_(conv.weight, std=0.05)
            torch.nn.init.normal_(conv.bias, std=0.05)
    return controlnet.eval().requires_grad_(False)


def load_controlnet(path: str | Path) -> ControlNetModel:
    """A diffusers ControlNet directory from local disk only (never a hub), its weights from ``.safetensors``
    only (a pickled ``.bin`` is refused unopened)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a diffusers ControlNet directory (no config.json)")
    controlnet = ControlNetModel.from_pretrained(path, local_files_only=True, use_safetensors=True)
    return controlnet.eval().requires_grad_(False)
