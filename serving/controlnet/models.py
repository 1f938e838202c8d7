"""ControlNet models: seeded presets matching the diffusion presets, or local diffusers directories.

A preset ControlNet is built from its diffusion preset's denoiser: ``ControlNetModel`` from a UNet (SD, SDXL),
``SD3ControlNetModel`` from an SD3 transformer, ``FluxControlNetModel`` from a Flux transformer. ``load_controlnet``
serves any of them from a local directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    ControlNetModel,
    FluxControlNetModel,
    FluxTransformer2DModel,
    SD3ControlNetModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
)

from serving.preset_catalog import PRESET_FAMILIES, WeightsChoice, preset_weights
from serving.presets import Denoiser, build_preset

# UNet presets' conditioning-embedding widths: one stride-2 stage per factor of 2 between image and latent.
_CONDITIONING_CHANNELS = {"tiny": (16, 32, 64), "sd15-shape": (16, 32, 96, 256), "sdxl-tiny": (16, 32),
                          "sdxl-shape": (16, 32, 96, 256)}
#: SD3 presets: a one-block ControlNet over the transformer's first block (it conditions on VAE latents).
_SD3_PRESETS = ("sd3-tiny",)
#: Flux presets: a ControlNet of one double- and one single-stream block copied from the transformer (InstantX's
#: kind: it conditions on packed VAE latents).
_FLUX_PRESETS = ("flux-tiny", "flux-schnell-tiny")
CONTROLNET_PRESETS: tuple[str, ...] = (*_CONDITIONING_CHANNELS, *_SD3_PRESETS, *_FLUX_PRESETS)
AnyControlNet = ControlNetModel | SD3ControlNetModel | FluxControlNetModel
#: The ControlNet classes ``load_controlnet`` serves, by a directory's config.json ``_class_name``.
_CLASSES: dict[str, type[AnyControlNet]] = {
    "ControlNetModel": ControlNetModel, "SD3ControlNetModel": SD3ControlNetModel,
    "FluxControlNetModel": FluxControlNetModel}


def controlnet_family(preset: str | None, path: str | Path | None) -> str:
    """The model family a configured ControlNet conditions: its preset's, or its directory's by the class its
    config.json names (a ``ControlNetModel`` with SDXL's added embedding is sdxl's); ValueError for a directory
    that is not a ControlNet."""
    if preset is not None:
        return PRESET_FAMILIES[preset]
    assert path is not None
    config = _directory_config(Path(path))
    class_name = config.get("_class_name", "ControlNetModel")
    if class_name == "SD3ControlNetModel":
        return "sd3"
    if class_name == "FluxControlNetModel":
        return "flux"
    return "sdxl" if config.get("addition_embed_type") == "text_time" else "sd"


def controlnet_preset_weights(name: str) -> Path | None:
    """The shipped trained ControlNet of diffusion preset ``name`` (``tiny``: canny edges), or None."""
    pipeline = preset_weights(name)
    return pipeline / "controlnet" if pipeline is not None and (pipeline / "controlnet" / "config.json").is_file() \
        else None


def build_controlnet_preset(name: str, seed: int = 0, *, weights: WeightsChoice = "seeded", zero_init: bool = False,
                            denoiser: Denoiser | None = None) -> AnyControlNet:
    """A ControlNet for diffusion preset ``name``. ``auto`` weights: the preset's shipped trained ControlNet
    where it has one. Otherwise seeded: its encoder (SD3: its first transformer block) copied from ``denoiser``
    (default: the preset's seeded one), as ControlNet training starts; zero-initialised layers stay zero with
    ``zero_init`` (the start of training), else they are drawn non-zero from ``seed`` so the residuals matter."""
    if name not in CONTROLNET_PRESETS:
        raise ValueError(f"unknown ControlNet preset {name!r}; known presets: {', '.join(CONTROLNET_PRESETS)}")
    trained = controlnet_preset_weights(name) if weights == "auto" else None
    if trained is not None:
        return load_controlnet(trained)
    denoiser = denoiser if denoiser is not None else build_preset(name, weights="seeded").denoiser
    expected = (SD3Transformer2DModel if name in _SD3_PRESETS else FluxTransformer2DModel if name in _FLUX_PRESETS
                else UNet2DConditionModel)
    if not isinstance(denoiser, expected):
        raise ValueError(f"ControlNet preset {name!r} is built from a {expected.__name__}, "
                         f"not a {type(denoiser).__name__}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(denoiser, SD3Transformer2DModel):
            controlnet = _sd3_from_transformer(denoiser)
            zero_layers = [*controlnet.controlnet_blocks, controlnet.pos_embed_input.proj]
        elif isinstance(denoiser, FluxTransformer2DModel):
            config = denoiser.config
            controlnet = FluxControlNetModel.from_transformer(
                denoiser, num_layers=1, num_single_layers=1, attention_head_dim=config.attention_head_dim,
                num_attention_heads=config.num_attention_heads)
            zero_layers = [*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks,
                           controlnet.controlnet_x_embedder]
        else:
            controlnet = ControlNetModel.from_unet(
                denoiser, conditioning_embedding_out_channels=_CONDITIONING_CHANNELS[name])
            zero_layers = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                           controlnet.controlnet_cond_embedding.conv_out]
        if zero_init:
            return controlnet
        for layer in zero_layers:
            torch.nn.init.normal_(layer.weight, std=0.05)
            torch.nn.init.normal_(layer.bias, std=0.05)
    return controlnet.eval().requires_grad_(False)


def _sd3_from_transformer(transformer: SD3Transformer2DModel) -> SD3ControlNetModel:
    """``SD3ControlNetModel.from_transformer(transformer, num_layers=1, num_extra_conditioning_channels=0)``
    without its side effect (diffusers writes both values into ``transformer.config``)."""
    controlnet = SD3ControlNetModel.from_config(
        {**transformer.config, "num_layers": 1, "extra_conditioning_channels": 0})
    for name in ("pos_embed", "time_text_embed", "context_embedder"):
        getattr(controlnet, name).load_state_dict(getattr(transformer, name).state_dict())
    controlnet.transformer_blocks.load_state_dict(transformer.transformer_blocks.state_dict(), strict=False)
    return controlnet


def load_controlnet(path: str | Path) -> AnyControlNet:
    """A diffusers ControlNet directory from local disk only (never a hub), its weights from ``.safetensors``
    only (a pickled ``.bin`` is refused unopened): an ``SD3ControlNetModel`` or ``FluxControlNetModel`` where its
    config.json's ``_class_name`` says so, else a ``ControlNetModel``. SD3 ControlNets that need the base
    transformer's positional embedding (``use_pos_embed`` false, SD3.5 8B) or extra conditioning channels
    (inpainting) are refused, as are Flux ControlNets with modes (union) or an image hint block (XLabs')."""
    path = Path(path)
    config = _directory_config(path)
    class_name = config.get("_class_name", "ControlNetModel")
    if class_name not in _CLASSES:
        raise ValueError(f"{path} holds a {class_name!r}; served ControlNet classes: {', '.join(_CLASSES)}")
    if class_name == "SD3ControlNetModel" and (config.get("use_pos_embed") is False
                                               or config.get("extra_conditioning_channels")):
        raise ValueError(f"{path}: SD3 ControlNets without their own positional embedding (use_pos_embed false) or "
                         "with extra conditioning channels are not served")
    if class_name == "FluxControlNetModel" and (config.get("num_mode") is not None
                                                or config.get("conditioning_embedding_channels") is not None):
        raise ValueError(f"{path}: Flux ControlNets with modes (union ControlNets, num_mode) or an image hint block "
                         "(XLabs', conditioning_embedding_channels) are not served")
    controlnet = _CLASSES[class_name].from_pretrained(path, local_files_only=True, use_safetensors=True)
    return controlnet.eval().requires_grad_(False)


def _directory_config(path: Path) -> dict:
    """A ControlNet directory's config.json, or ValueError."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} is not a diffusers ControlNet directory (no config.json)")
    config = json.loads(config_path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    return config
