"""Running one ControlNet on a batch of rows, possibly from several requests and calls.

A call carries the rows of one UNet step that use this ControlNet: noisy latents, timesteps, text
embeddings (and where each row's comes from, so a remote call sends each request's once), for SDXL the added
inputs (pooled embedding, size ids), per-row conditioning scales, and each request's conditioning image once
(with how many rows it covers).
Residuals come back already scaled, as ``MultiControlNetModel`` sums them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from diffusers import ControlNetModel

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
    images: list[tuple[torch.Tensor, int]]  # ([1, 3, H, W] conditioning image, rows it covers), in row order
    added: dict[str, torch.Tensor] = field(default_factory=dict)  # the added inputs per row [R, ...] (SDXL)

    @property
    def rows(self) -> int:
        return self.sample.shape[0]


@dataclass
class ControlNetResiduals:
    """Down-block residuals (one per UNet skip connection) and the mid-block residual, scaled per row."""

    down: list[torch.Tensor]
    mid: torch.Tensor


def merge_calls(calls: Sequence[ControlNetCall]) -> ControlNetCall:
    """One call with every row of ``calls``, in order."""
    if len(calls) == 1:
        return calls[0]
    return ControlNetCall(
        sample=torch.cat([c.sample for c in calls]),
        timestep=torch.cat([c.timestep for c in calls]),
        encoder_hidden_states=torch.cat([c.encoder_hidden_states for c in calls]),
        context_rows=[row for c in calls for row in c.context_rows],
        scales=torch.cat([c.scales for c in calls]),
        images=[image for c in calls for image in c.images],
        added={name: torch.cat([c.added[name] for c in calls]) for name in calls[0].added},
    )


def split_residuals(residuals: ControlNetResiduals, rows: Sequence[int]) -> list[ControlNetResiduals]:
    """Inverse of ``merge_calls`` on the result; each part contiguous so it ships without extra copies."""
    if len(rows) == 1:
        return [residuals]
    downs = [torch.split(block, list(rows)) for block in residuals.down]
    mids = torch.split(residuals.mid, list(rows))
    return [ControlNetResiduals([d[i].contiguous() for d in downs], mids[i].contiguous()) for i in range(len(rows))]


class ControlNetRunner:
    """One ControlNet model on one device."""

    def __init__(self, model: ControlNetModel, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.model = model.to(device) if dtype == torch.float32 else model.to(device=device, dtype=dtype)
        self.device, self.dtype = device, dtype

    @torch.inference_mode()
    def run(self, call: ControlNetCall) -> ControlNetResiduals:
        device, dtype = self.device, self.dtype
        images = torch.cat([image.to(device, dtype).expand(rows, -1, -1, -1) for image, rows in call.images])
        down, mid = self.model(
            call.sample.to(device, dtype),
            call.timestep.to(device),
            encoder_hidden_states=call.encoder_hidden_states.to(device, dtype),
            controlnet_cond=images,
            conditioning_scale=1.0,
            added_cond_kwargs={name: value.to(device, dtype) for name, value in call.added.items()} or None,
            return_dict=False,
        )
        scales = call.scales.to(device, dtype).view(-1, 1, 1, 1)
        return ControlNetResiduals([block * scales for block in down], mid * scales)
