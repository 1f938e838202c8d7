"""``UNet2DConditionModel.forward`` cut in two at the ControlNet injection point, so the engine runs the down blocks
and the mid block while remote ControlNets compute the same step's residuals (added only afterwards: to the skip
connections, which the up blocks read, and to the mid block's output).

The arithmetic is diffusers' own for Stable Diffusion 1.x/2.x and SDXL UNets (SDXL's ``text_time`` added embedding;
no class embeddings, other added embeddings, attention masks, adapters or GLIGEN); other UNets are refused at
construction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from diffusers import UNet2DConditionModel


@dataclass
class DownPass:
    """What the second half needs from the first: the mid block's output, before any ControlNet residual."""

    sample: torch.Tensor
    emb: torch.Tensor
    encoder_hidden_states: torch.Tensor
    skips: tuple[torch.Tensor, ...]
    forward_upsample_size: bool


class SplitUNet:
    """The two halves of one UNet's forward. Stateless: safe to share."""

    def __init__(self, unet: UNet2DConditionModel) -> None:
        config = unet.config
        unsupported = [
            name for name, value in (
                ("class_embed_type", config.class_embed_type),
                ("addition_embed_type", None if config.addition_embed_type == "text_time"
                 else config.addition_embed_type),
                ("encoder_hid_dim_type", config.encoder_hid_dim_type),
                ("center_input_sample", config.center_input_sample or None),
                ("time_cond_proj_dim", config.time_cond_proj_dim),
            ) if value is not None
        ]
        if unsupported:
            raise ValueError(f"UNet features not supported by the split forward: {', '.join(unsupported)}")
        self.unet = unet

    def down(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
             added: Mapping[str, torch.Tensor] | None = None) -> DownPass:
        """The time embedding (plus the added one, from ``added``: SDXL's ``text_embeds`` and ``time_ids``),
        ``conv_in``, the down blocks and the mid block."""
        unet = self.unet
        up_factor = 2**unet.num_upsamplers
        forward_upsample_size = any(dim % up_factor for dim in sample.shape[-2:])
        emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep))
        if unet.config.addition_embed_type is not None:
            emb = emb + unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                                           added_cond_kwargs=dict(added or {}))
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        sample = unet.conv_in(sample)
        skips: tuple[torch.Tensor, ...] = (sample,)
        for block in unet.down_blocks:
            if getattr(block, "has_cross_attention", False):
                sample, residuals = block(hidden_states=sample, temb=emb, encoder_hidden_states=encoder_hidden_states)
            else:
                sample, residuals = block(hidden_states=sample, temb=emb)
            skips += residuals
        if unet.mid_block is not None:
            if getattr(unet.mid_block, "has_cross_attention", False):
                sample = unet.mid_block(sample, emb, encoder_hidden_states=encoder_hidden_states)
            else:
                sample = unet.mid_block(sample, emb)
        return DownPass(sample, emb, encoder_hidden_states, skips, forward_upsample_size)

    def up(self, state: DownPass, down_residuals: Sequence[torch.Tensor] | None = None,
           mid_residual: torch.Tensor | None = None) -> torch.Tensor:
        """ControlNet residuals added to the skip connections and the mid-block output, then the up blocks to the
        noise prediction; ``ValueError`` if the residuals do not match the skips."""
        unet = self.unet
        skips = state.skips
        if down_residuals is not None:
            if len(down_residuals) != len(skips):
                raise ValueError(f"expected {len(skips)} down-block residuals, got {len(down_residuals)}")
            skips = tuple(skip + residual for skip, residual in zip(skips, down_residuals, strict=True))
        sample, emb, context = state.sample, state.emb, state.encoder_hidden_states
        if mid_residual is not None:
            sample = sample + mid_residual
        for index, block in enumerate(unet.up_blocks):
            block_skips, skips = skips[-len(block.resnets):], skips[: -len(block.resnets)]
            last = index == len(unet.up_blocks) - 1
            upsample_size = skips[-1].shape[2:] if state.forward_upsample_size and not last else None
            if getattr(block, "has_cross_attention", False):
                sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=block_skips,
                               encoder_hidden_states=context, upsample_size=upsample_size)
            else:
                sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=block_skips,
                               upsample_size=upsample_size)
        if unet.conv_norm_out is not None:
            sample = unet.conv_act(unet.conv_norm_out(sample))
        return unet.conv_out(sample)
