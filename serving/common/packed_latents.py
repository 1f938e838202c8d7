"""Flux's view of latents: [R, C, h, w] packed 2x2 into tokens [R, h/2 * w/2, 4C], each token's position, as
``FluxPipeline`` packs them; shared by the Flux denoiser and its ControlNets."""

from __future__ import annotations

import torch


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[R, C, h, w] latents as Flux's tokens [R, h/2 * w/2, 4C] (``FluxPipeline._pack_latents``)."""
    rows, channels, height, width = latents.shape
    patches = latents.view(rows, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(rows, (height // 2) * (width // 2), channels * 4)


def unpack_latents(tokens: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    """The inverse of ``pack_latents``: [R, h/2 * w/2, 4C] tokens as [R, C, h, w] latents."""
    rows = tokens.shape[0]
    patches = tokens.view(rows, height // 2, width // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(rows, channels, height, width)


def latent_positions(height: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """Each packed token's (0, row, column) [h/2 * w/2, 3] (``FluxPipeline._prepare_latent_image_ids``)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(like.device, like.dtype)
