"""``RowBatch``: the rows of one denoiser forward, whichever requests they come from.

Each row carries its own timestep, text embedding (and the denoiser's added inputs: SDXL's pooled text embedding
and size ids, SD3's pooled text embedding), LoRAs and ControlNet conditions, so a forward can
mix requests freely, and a subset of rows (the unconditional half, for parallel CFG) can be cut out
and computed elsewhere. Each row also knows which request tensor its text embedding comes from
(``context_rows``), so what computes it elsewhere is sent each request's embeddings once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from serving.controlnet.runner import ContextRow
from serving.engine.request import RequestState
from serving.lora.weights import LoRAWeights

RowLoRAs = tuple[tuple[LoRAWeights, float], ...]  # (weights, request scale)
RowControls = tuple[tuple[str, torch.Tensor, float], ...]  # (ControlNet name, [1, 3, H, W] image, scale)


@dataclass
class RowBatch:
    sample: torch.Tensor  # model input: latents scaled by each request's scheduler (+ inpainting inputs) [R, C, h, w]
    timestep: torch.Tensor  # [R]
    context: torch.Tensor  # text embeddings [R, S, D]
    context_rows: list[ContextRow]  # where each row of ``context`` comes from
    loras: list[RowLoRAs]
    controls: list[RowControls]
    added: dict[str, torch.Tensor] = field(default_factory=dict)  # the denoiser's added inputs [R, ...] (SDXL, SD3)

    @property
    def rows(self) -> int:
        return self.sample.shape[0]

    def select(self, index: Sequence[int]) -> RowBatch:
        positions = torch.tensor(list(index), dtype=torch.long, device=self.sample.device)
        return RowBatch(
            sample=self.sample.index_select(0, positions),
            timestep=self.timestep.index_select(0, positions.to(self.timestep.device)),
            context=self.context.index_select(0, positions),
            context_rows=[self.context_rows[i] for i in index],
            loras=[self.loras[i] for i in index],
            controls=[self.controls[i] for i in index],
            added={name: value.index_select(0, positions) for name, value in self.added.items()},
        )

    def to(self, device: torch.device) -> RowBatch:
        """The same rows with their activations on ``device`` (LoRAs and images are moved by their users)."""
        return RowBatch(self.sample.to(device), self.timestep.to(device), self.context.to(device),
                        self.context_rows, self.loras, self.controls,
                        {name: value.to(device) for name, value in self.added.items()})

    @classmethod
    def for_states(cls, states: Sequence[RequestState]) -> RowBatch:
        """All rows of ``states`` at their current step: per CFG request its unconditional rows, then its
        conditional rows (the order diffusers concatenates them in)."""
        samples, timesteps, contexts, context_rows, loras, controls = [], [], [], [], [], []
        added: dict[str, list[torch.Tensor]] = {}
        for state in states:
            t = state.timesteps[state.step_index]
            latents = torch.cat([state.latents] * 2) if state.params.uses_cfg else state.latents
            scale = getattr(state.scheduler, "scale_model_input", None)  # flow matching: none
            sample = scale(latents, t) if scale is not None else latents
            if state.denoiser_inputs is not None:  # an inpainting denoiser's mask and masked image, unscaled
                sample = torch.cat([sample, state.denoiser_inputs], dim=1)
            samples.append(sample)
            timesteps.append(t.expand(state.rows))
            context = state.context
            contexts.append(context)
            context_rows += [(context, row) for row in range(state.rows)]
            loras += [tuple(state.active_loras)] * state.rows
            controls += [tuple(state.controls)] * state.rows
            for name, value in state.added.items():
                added.setdefault(name, []).append(value)
        return cls(torch.cat(samples), torch.cat(timesteps), torch.cat(contexts), context_rows, loras, controls,
                   {name: torch.cat(values) for name, values in added.items()})
