"""The VAE's side of the denoiser's latents: the scaling (and SD3's shift) between the two, and decoded pixels as
images, as diffusers' pipelines apply them."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL


def vae_shift(vae: AutoencoderKL) -> float:
    """SD3's VAE ``shift_factor`` (0 for SD and SDXL)."""
    return vae.config.get("shift_factor") or 0.0


def to_denoiser_latents(vae: AutoencoderKL, encoded: torch.Tensor) -> torch.Tensor:
    """A VAE latent (a sample or the mode of its distribution) as the denoiser's latents: ``(z - shift) * scaling``."""
    return (encoded - vae_shift(vae)) * vae.config.scaling_factor


def encode_mode(vae: AutoencoderKL, pixels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] as the denoiser's latents of their VAE distribution's mode (one latent per
    image, no generator), encoded in ``dtype`` (the VAE's)."""
    return to_denoiser_latents(vae, vae.encode((pixels * 2 - 1).to(dtype)).latent_dist.mode())


def to_vae_latents(vae: AutoencoderKL, latents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The denoiser's latents as the VAE decodes them, in ``dtype``: ``z / scaling + shift``."""
    return latents.to(dtype) / vae.config.scaling_factor + vae_shift(vae)


def to_images(decoded: torch.Tensor) -> np.ndarray:
    """VAE output [n, 3, H, W] in [-1, 1] as float32 images [n, H, W, 3] in [0, 1]."""
    return (decoded / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
