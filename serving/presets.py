"""Diffusion model sources: built-in presets (built offline, seeded) and local diffusers directories.

``tiny``       a small text-to-image model (64x64 images) for tests and the default deployment.
``sd15-shape`` the Stable Diffusion 1.5 architecture with random weights: realistic compute for benchmarks.

Presets are constructed in memory from fixed configs and a seed, so two builds are bit-identical and
nothing is downloaded. Real checkpoints load from a local directory with ``local_files_only=True``, their
weights from ``.safetensors`` files only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    ControlNetModel,
    DDIMScheduler,
    MultiControlNetModel,
    SchedulerMixin,
    StableDiffusionControlNetPipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from serving._private.tokenizer import build_tokenizer
from serving.preset_catalog import WEIGHTS_CHOICES, WeightsChoice, check_preset, preset_weights


@dataclass
class DiffusionComponents:
    """The parts of a Stable-Diffusion-style text-to-image model."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizer
    scheduler: SchedulerMixin

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def default_size(self) -> int:
        """Native image side in pixels."""
        return self.unet.config.sample_size * self.vae_scale_factor

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this: 8, as diffusers' pipelines require, or a coarser VAE grid."""
        return max(8, self.vae_scale_factor)

    def modules(self) -> dict[str, torch.nn.Module]:
        return {"unet": self.unet, "vae": self.vae, "text_encoder": self.text_encoder}

    def freeze(self) -> DiffusionComponents:
        """Inference mode for every module: eval, no gradients. Weights are shared, never trained here."""
        for module in self.modules().values():
            module.eval().requires_grad_(False)
        return self

    def as_pipeline(self) -> StableDiffusionPipeline:
        """A diffusers pipeline over these same modules (no copies), without a safety checker."""
        return StableDiffusionPipeline(**self._pipeline_parts())

    def as_controlnet_pipeline(self, controlnets: Sequence[ControlNetModel]) -> StableDiffusionControlNetPipeline:
        """diffusers' ControlNet pipeline over these modules (the reference our engine is tested against);
        several ControlNets are combined by ``MultiControlNetModel``, as diffusers does."""
        controlnet = controlnets[0] if len(controlnets) == 1 else MultiControlNetModel(list(controlnets))
        return StableDiffusionControlNetPipeline(**self._pipeline_parts(), controlnet=controlnet)

    def _pipeline_parts(self) -> dict:
        """The constructor arguments both diffusers pipelines share (no safety checker)."""
        return {
            "unet": self.unet,
            "vae": self.vae,
            "text_encoder": self.text_encoder,
            "tokenizer": self.tokenizer,
            "scheduler": self.scheduler,
            "safety_checker": None,
            "feature_extractor": None,
            "requires_safety_checker": False,
        }


def _sd_scheduler() -> DDIMScheduler:
    """DDIM with Stable Diffusion 1.x's noise schedule."""
    return DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _text_encoder(tokenizer: CLIPTokenizer, **arch: int) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch,
    )
    return CLIPTextModel(config)


def _build_tiny() -> DiffusionComponents:
    tokenizer = build_tokenizer()
    return DiffusionComponents(
        unet=UNet2DConditionModel(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64, 128),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=64,
            attention_head_dim=8,
            norm_num_groups=32,
        ),
        vae=AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            block_out_channels=(16, 32, 64),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=64,
        ),
        text_encoder=_text_encoder(
            tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        ),
        tokenizer=tokenizer,
        scheduler=_sd_scheduler(),
    )


def _build_sd15_shape() -> DiffusionComponents:
    tokenizer = build_tokenizer()
    return DiffusionComponents(
        unet=UNet2DConditionModel(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            block_out_channels=(320, 640, 1280, 1280),
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
        ),
        vae=AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=4,
            sample_size=512,
        ),
        text_encoder=_text_encoder(
            tokenizer, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
        ),
        tokenizer=tokenizer,
        scheduler=_sd_scheduler(),
    )


#: The builder of each preset in ``serving.preset_catalog.PRESET_NAMES``.
_BUILDERS: dict[str, Callable[[], DiffusionComponents]] = {
    "tiny": _build_tiny,
    "sd15-shape": _build_sd15_shape,
}


def build_preset(name: str, seed: int = 0, *, weights: WeightsChoice = "seeded") -> DiffusionComponents:
    """Build preset ``name``: ``seeded`` draws its weights from ``seed`` (the global RNG state is left
    untouched); ``auto`` loads the preset's shipped trained weights where it has some, else seeds."""
    check_preset(name)
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_CHOICES)}, got {weights!r}")
    trained = preset_weights(name) if weights == "auto" else None
    if trained is not None:
        return load_local(trained)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components = _BUILDERS[name]()
    return components.freeze()


def load_local(path: str | Path) -> DiffusionComponents:
    """Load a diffusers text-to-image directory from local disk only (never a hub), its weights from
    ``.safetensors`` files only (a pickled ``.bin`` is refused unopened: pickle can run code)."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise ValueError(f"{path} is not a diffusers model directory (no model_index.json)")
    pipe = StableDiffusionPipeline.from_pretrained(
        path, local_files_only=True, use_safetensors=True, safety_checker=None, requires_safety_checker=False,
        dtype=torch.float32,
    )
    return DiffusionComponents(
        unet=pipe.unet,
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        scheduler=pipe.scheduler,
    ).freeze()
