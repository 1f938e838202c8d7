"""Previews of a request's latents while it denoises (the streamed partial images), and when they are taken.

``LatentRGBPreview`` (``approx``, the default) maps latents to RGB with one linear map per model, a [C+1, 3] matrix
(a weight per latent channel and a bias), as A1111's and ComfyUI's "latent2rgb" previews do. It is fitted once, by
least squares on the model's own VAE: deterministic synthetic images (colour fields, gradients, rectangles and
discs; seeded numpy, no files) are encoded (``latent_dist.mode()``, then ``(z - shift) * scaling`` as the engine's
latents are) and decoded back, the decodes are average-pooled to latent resolution, and the map solves latents ->
those pixels (fitting the decoder's view, not the input images). A preview then costs one [n*h*w, C+1] x [C+1, 3]
product and a bilinear upsample, plus the PNG encode every preview pays (what previews cost a loaded engine:
``benchmarks/results/bench_streaming.md``). The fit runs once per engine loop, at its first preview.
``VAEPreview`` (``vae``) decodes with the full VAE instead: the exact image at a VAE decode per preview.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

from serving.engine.vae import encode_mode, to_images, to_vae_latents

#: Which decoder makes the previews: the fitted linear map, or the model's VAE.
PreviewKind = Literal["approx", "vae"]

_FIT_SEED = 0
_FIT_IMAGES_PER_KIND = 8  # colour fields, gradients, shapes: 24 images in all
_FIT_LATENT_SIDE = 16  # the fit images' side in latent positions (64 px for the tiny preset, 128 px for SD)


class PreviewDecoder(Protocol):
    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Latents [n, C, h, w] (as the engine denoises them) as float32 images [n, height, width, 3] in [0, 1]."""


def preview_steps(steps: int, partial_images: int) -> list[int]:
    """The steps (1-based, after which a preview is taken) of a request of ``steps`` steps asking for
    ``partial_images`` previews: round((j+1) * steps / (k+1)) for j < k, halves up, deduplicated, each in
    [1, steps - 1] (never the last step: the result shows it). Few steps give fewer previews (2 steps: one)."""
    k = partial_images
    chosen = {math.floor((j + 1) * steps / (k + 1) + 0.5) for j in range(k)}
    return sorted(step for step in chosen if 1 <= step < steps)


def fit_images(side: int, seed: int = _FIT_SEED) -> np.ndarray:
    """The deterministic fit set: float32 [N, 3, side, side] in [0, 1]: flat colours (black and white among them),
    two-colour linear gradients, and rectangles and discs on a flat background."""
    rng = np.random.default_rng(seed)
    grid = np.mgrid[0:side, 0:side].astype(np.float32) / max(side - 1, 1)  # [2, side, side]: y, x in [0, 1]
    images = []
    fields = rng.random((_FIT_IMAGES_PER_KIND, 3), dtype=np.float32)
    fields[:2] = [[0, 0, 0], [1, 1, 1]]
    images += [np.broadcast_to(colour[:, None, None], (3, side, side)) for colour in fields]
    for _ in range(_FIT_IMAGES_PER_KIND):
        start, end = rng.random((2, 3), dtype=np.float32)
        angle = rng.uniform(0, 2 * np.pi)
        ramp = np.cos(angle) * grid[1] + np.sin(angle) * grid[0]
        ramp = (ramp - ramp.min()) / max(np.ptp(ramp), 1e-6)
        images.append(start[:, None, None] * (1 - ramp) + end[:, None, None] * ramp)
    for _ in range(_FIT_IMAGES_PER_KIND):
        image = np.broadcast_to(rng.random((3, 1, 1), dtype=np.float32), (3, side, side)).copy()
        for _ in range(3):
            (y, x), radius, colour = rng.random(2), rng.uniform(0.1, 0.35), rng.random(3, dtype=np.float32)
            if rng.random() < 0.5:
                inside = (np.abs(grid[0] - y) < radius) & (np.abs(grid[1] - x) < radius)
            else:
                inside = (grid[0] - y) ** 2 + (grid[1] - x) ** 2 < radius**2
            image[:, inside] = colour[:, None]
        images.append(image)
    return np.stack(images).astype(np.float32)


class LatentRGBPreview:
    """Latents -> RGB by a fitted linear map ``[C+1, 3]`` (``fit``), clamped to [0, 1] and upsampled bilinearly."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights  # [C+1, 3]: the channels' RGB contributions, then the bias row

    @classmethod
    @torch.inference_mode()
    def fit(cls, vae: AutoencoderKL, vae_scale_factor: int) -> LatentRGBPreview:
        """The least-squares map from ``vae``'s latents of the fit images to their decodes pooled to latent size."""
        parameter = next(vae.parameters())
        pixels = torch.from_numpy(fit_images(_FIT_LATENT_SIDE * vae_scale_factor))
        latents = encode_mode(vae, pixels.to(parameter.device), parameter.dtype)
        decoded = torch.from_numpy(VAEPreview(vae, parameter.dtype).decode(latents, *pixels.shape[2:]))
        targets = F.avg_pool2d(decoded.permute(0, 3, 1, 2), vae_scale_factor)  # [N, 3, h, w], as the latents
        latents = latents.float().cpu()
        inputs = torch.cat([latents, torch.ones_like(latents[:, :1])], dim=1)
        solution = torch.linalg.lstsq(_flat(inputs), _flat(targets)).solution
        return cls(solution)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        weights = self.weights.to(latents.device)
        rgb = torch.einsum("nchw,cd->ndhw", latents.float(), weights[:-1]) + weights[-1].view(1, 3, 1, 1)
        rgb = F.interpolate(rgb.clamp(0, 1), size=(height, width), mode="bilinear", align_corners=False)
        return rgb.permute(0, 2, 3, 1).cpu().numpy()


class VAEPreview:
    """The exact image: a full VAE decode per preview (on this replica's device; never split with a CFG worker)."""

    def __init__(self, vae: AutoencoderKL, vae_dtype: torch.dtype) -> None:
        self.vae, self.vae_dtype = vae, vae_dtype

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        return to_images(self.vae.decode(to_vae_latents(self.vae, latents, self.vae_dtype), return_dict=False)[0])


def preview_decoder(kind: PreviewKind, vae: AutoencoderKL, vae_scale_factor: int,
                    vae_dtype: torch.dtype) -> PreviewDecoder:
    """The decoder ``kind`` names for a model with this VAE (``approx`` is fitted now)."""
    if kind == "vae":
        return VAEPreview(vae, vae_dtype)
    return LatentRGBPreview.fit(vae, vae_scale_factor)


def _flat(images: torch.Tensor) -> torch.Tensor:
    """[N, C, h, w] -> [N*h*w, C]: one row per position."""
    return images.permute(0, 2, 3, 1).reshape(-1, images.shape[1])
