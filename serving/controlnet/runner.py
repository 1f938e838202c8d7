"""Running one ControlNet on a batch of rows, possibly from several requests and calls.

A call carries the rows of one denoiser step that use this ControlNet: noisy latents, timesteps, text
embeddings (and where each row's comes from, so a remote call sends each request's once), the added inputs (SDXL:
pooled embedding, size ids; SD3: ``pooled_projections``), per-row conditioning scales, and each request's
conditioning image once (with how many rows it covers).
UNet ControlNets (SD, SDXL) take the RGB image and return down-block and mid-block residuals. SD3 ControlNets take
the image already VAE-encoded, ``(latent - shift_factor) * scaling_factor`` with ``latent_shift = shift_factor *
scaling_factor``, and return one residual per ControlNet block ([R, tokens, dim]) and no mid residual; they run as
``StableDiffusion3ControlNetPipeline`` runs them. Flux ControlNets take the latents the same way (shift taken
out), packed into tokens as the rows' latents are, and return block and single-block samples.
Residuals come back already scaled, as ``MultiControlNetModel`` sums them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from diffusers import ControlNetModel, FluxControlNetModel, SD3ControlNetModel

from serving.common.packed_latents import latent_positions, pack_latents

#: Where a row's text embedding lives: its request's embeddings [rows, S, D] (one tensor for the request's life, or
#: until its LoRAs re-encode its text) and the row's index in them.
ContextRow = tuple[torch.Tensor, int]


def gather_context(rows: Sequence[ContextRow]) -> torch.Tensor:
    """The embeddings ``rows`` point to, one per row [R, S, D]."""
    return torch.stack([context[index] for context, index in rows])


@dataclass
class ControlNetCall:
    """The rows of one step that use one ControlNet."""

    sample: torch.Tensor  # [R, C, h, w]
    timestep: torch.Tensor  # [R]
    encoder_hidden_states: torch.Tensor  # [R, S, D]
    context_rows: list[ContextRow]  # where each row of encoder_hidden_states comes from
    scales: torch.Tensor  # [R]
    images: list[tuple[torch.Tensor, int]]  # ([1, 3, H, W] image, SD3: [1, C, h, w] latent; rows), in row order
    added: dict[str, torch.Tensor] = field(default_factory=dict)  # the added inputs per row [R, ...] (SDXL, SD3)
    latent_shift: float = 0.0  # SD3: the VAE's shift_factor * scaling_factor, taken out of the images' latents

    @property
    def rows(self) -> int:
        return self.sample.shape[0]


@dataclass
class ControlNetResiduals:
    """Scaled per row: down-block residuals (one per UNet skip connection) and the mid-block residual; SD3: the
    ControlNet's block samples [R, tokens, dim] and no mid residual; Flux: its block samples and its single-block
    samples (``single``)."""

    down: list[torch.Tensor]
    mid: torch.Tensor | None
    single: list[torch.Tensor] = field(default_factory=list)


def merge_calls(calls: Sequence[ControlNetCall]) -> ControlNetCall:
    """One call with every row of ``calls``, in order; they must share their ``latent_shift``."""
    if len(calls) == 1:
        return calls[0]
    if len({c.latent_shift for c in calls}) > 1:
        raise ValueError(f"calls with different latent shifts cannot merge: {sorted({c.latent_shift for c in calls})}")
    return ControlNetCall(
        sample=torch.cat([c.sample for c in calls]),
        timestep=torch.cat([c.timestep for c in calls]),
        encoder_hidden_states=torch.cat([c.encoder_hidden_states for c in calls]),
        context_rows=[row for c in calls for row in c.context_rows],
        scales=torch.cat([c.scales for c in calls]),
        images=[image for c in calls for image in c.images],
        added={name: torch.cat([c.added[name] for c in calls]) for name in calls[0].added},
        latent_shift=calls[0].latent_shift,
    )


def split_residuals(residuals: ControlNetResiduals, rows: Sequence[int]) -> list[ControlNetResiduals]:
    """Inverse of ``merge_calls`` on the result; each part contiguous so it ships without extra copies."""
    if len(rows) == 1:
        return [residuals]
    downs = [torch.split(block, list(rows)) for block in residuals.down]
    mids = torch.split(residuals.mid, list(rows)) if residuals.mid is not None else None
    singles = [torch.split(block, list(rows)) for block in residuals.single]
    return [ControlNetResiduals([d[i].contiguous() for d in downs], mids[i].contiguous() if mids is not None else None,
                                [s[i].contiguous() for s in singles])
            for i in range(len(rows))]


class ControlNetRunner:
    """One ControlNet model on one device; the model's class picks how it runs."""

    def __init__(self, model: ControlNetModel | SD3ControlNetModel | FluxControlNetModel, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model.to(device) if dtype == torch.float32 else model.to(device=device, dtype=dtype)
        self.device, self.dtype = device, dtype

    @torch.inference_mode()
    def run(self, call: ControlNetCall) -> ControlNetResiduals:
        if isinstance(self.model, SD3ControlNetModel):
            return self._run_sd3(call)
        if isinstance(self.model, FluxControlNetModel):
            return self._run_flux(call)
        device, dtype = self.device, self.dtype
        down, mid = self.model(
            call.sample.to(device, dtype),
            call.timestep.to(device),
            encoder_hidden_states=call.encoder_hidden_states.to(device, dtype),
            controlnet_cond=self._images(call),
            conditioning_scale=1.0,
            added_cond_kwargs={name: value.to(device, dtype) for name, value in call.added.items()} or None,
            return_dict=False,
        )
        scales = call.scales.to(device, dtype).view(-1, 1, 1, 1)
        return ControlNetResiduals([block * scales for block in down], mid * scales)

    def _run_sd3(self, call: ControlNetCall) -> ControlNetResiduals:
        """As ``StableDiffusion3ControlNetPipeline``: InstantX-style ControlNets (``force_zeros_for_pooled_projection``)
        take zero pooled projections and latents without the VAE shift; text embeddings only where the ControlNet
        embeds them (``joint_attention_dim``)."""
        device, dtype, config = self.device, self.dtype, self.model.config
        pooled = call.added["pooled_projections"].to(device, dtype)
        context = call.encoder_hidden_states.to(device, dtype) if config.joint_attention_dim is not None else None
        instantx = config.force_zeros_for_pooled_projection
        (blocks,) = self.model(
            hidden_states=call.sample.to(device, dtype),
            controlnet_cond=self._images(call, call.latent_shift if instantx else 0.0),
            conditioning_scale=1.0,
            encoder_hidden_states=context,
            pooled_projections=torch.zeros_like(pooled) if instantx else pooled,
            timestep=call.timestep.to(device),
            return_dict=False,
        )
        scales = call.scales.to(device, dtype).view(-1, 1, 1)
        return ControlNetResiduals([block * scales for block in blocks], None)

    def _run_flux(self, call: ControlNetCall) -> ControlNetResiduals:
        """As ``FluxControlNetPipeline`` with an InstantX-style ControlNet: the rows' latents and the control images'
        latents packed into tokens, each row's guidance where the ControlNet embeds guidance."""
        device, dtype = self.device, self.dtype
        sample = call.sample.to(device, dtype)
        height, width = sample.shape[-2:]
        context = call.encoder_hidden_states.to(device, dtype)
        guidance = call.added.get("guidance") if self.model.config.guidance_embeds else None
        blocks, single = self.model(
            hidden_states=pack_latents(sample),
            controlnet_cond=pack_latents(self._images(call)),
            conditioning_scale=1.0,
            timestep=call.timestep.to(device, dtype) / 1000,
            guidance=guidance.to(device) if guidance is not None else None,
            pooled_projections=call.added["pooled_projections"].to(device, dtype),
            encoder_hidden_states=context,
            txt_ids=context.new_zeros(context.shape[1], 3),
            img_ids=latent_positions(height, width, sample),
            return_dict=False,
        )
        scales = call.scales.to(device, dtype).view(-1, 1, 1)
        return ControlNetResiduals([block * scales for block in blocks], None,
                                   [block * scales for block in single or []])

    def _images(self, call: ControlNetCall, shift: float = 0.0) -> torch.Tensor:
        """Each row's conditioning input [R, ...], ``shift`` added to each image once."""
        return torch.cat([(image.to(self.device, self.dtype) + shift).expand(rows, -1, -1, -1)
                          for image, rows in call.images])
