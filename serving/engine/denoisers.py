"""Denoisers: a family's noise-predicting network behind one interface, with the point where ControlNet residuals
join its forward.

``UNetDenoiser`` (Stable Diffusion 1.x/2.x, SDXL): the residuals are added to the skip connections and the mid
block's output, so the down and mid blocks run before they are needed (``SplitUNet``): a remote ControlNet computes
while they do. ``SD3Denoiser`` (an MMDiT transformer): a residual is added after each transformer block, the first
one after block 0, so nothing useful overlaps with the ControlNet; it runs diffusers' own forward.
``FluxDenoiser`` (Flux.1): latents packed 2x2 into tokens around diffusers' own forward, as ``FluxPipeline`` packs
them; a ControlNet's block samples join the double-stream blocks, its single-block samples the single-stream ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel

from serving.common.packed_latents import latent_positions, pack_latents, unpack_latents
from serving.controlnet.runner import ControlNetResiduals
from serving.engine.unet_split import SplitUNet

#: Waits for a step's ControlNet residuals (summed over ControlNets, a row each).
PendingResiduals = Callable[[], ControlNetResiduals]


class Denoiser(ABC):
    """Predicts each row's noise (SD3: flow velocity) from its latents, timestep and text conditioning."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    @property
    def in_channels(self) -> int:
        return self.module.config.in_channels

    @abstractmethod
    def predict(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                added: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The prediction for every row: ``sample`` [R, C, h, w], ``timestep`` [R], ``context`` [R, S, D] and the
        family's added inputs by name, a row each."""

    @abstractmethod
    def predict_controlled(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                           added: Mapping[str, torch.Tensor], residuals: PendingResiduals) -> torch.Tensor:
        """``predict`` with ControlNet residuals; calls ``residuals`` once, after the work that does not need them."""


class UNetDenoiser(Denoiser):
    """A ``UNet2DConditionModel``; SDXL's added inputs (``text_embeds``, ``time_ids``) as ``added_cond_kwargs``."""

    def __init__(self, module: UNet2DConditionModel, *, controlled: bool) -> None:
        super().__init__(module)
        self._split = SplitUNet(module) if controlled else None  # refuses UNets it cannot split, at construction

    def predict(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                added: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.module(sample, timestep, encoder_hidden_states=context, added_cond_kwargs=dict(added) or None,
                           return_dict=False)[0]

    def predict_controlled(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                           added: Mapping[str, torch.Tensor], residuals: PendingResiduals) -> torch.Tensor:
        if self._split is None:
            raise RuntimeError("this UNet was set up without ControlNets")
        down = self._split.down(sample, timestep, context, added)
        summed = residuals()
        return self._split.up(down, summed.down, summed.mid)


class SD3Denoiser(Denoiser):
    """An ``SD3Transformer2DModel``; its added input is the pooled text embedding (``pooled_projections``)."""

    def predict(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                added: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._forward(sample, timestep, context, added, None)

    def predict_controlled(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                           added: Mapping[str, torch.Tensor], residuals: PendingResiduals) -> torch.Tensor:
        return self._forward(sample, timestep, context, added, residuals().down)

    def _forward(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                 added: Mapping[str, torch.Tensor], blocks: list[torch.Tensor] | None) -> torch.Tensor:
        return self.module(hidden_states=sample, timestep=timestep, encoder_hidden_states=context,
                           pooled_projections=added["pooled_projections"], block_controlnet_hidden_states=blocks,
                           return_dict=False)[0]


class FluxDenoiser(Denoiser):
    """A ``FluxTransformer2DModel`` on latents [R, C, h, w], packed into [R, h/2 * w/2, 4C] tokens with their
    positions and unpacked after; its added inputs are the pooled CLIP embedding (``pooled_projections``) and each
    row's ``guidance``, which only a guidance-distilled model ([dev]) embeds."""

    @property
    def in_channels(self) -> int:
        return self.module.config.in_channels // 4

    def predict(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                added: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._forward(sample, timestep, context, added, None)

    def predict_controlled(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                           added: Mapping[str, torch.Tensor], residuals: PendingResiduals) -> torch.Tensor:
        return self._forward(sample, timestep, context, added, residuals())

    def _forward(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                 added: Mapping[str, torch.Tensor], control: ControlNetResiduals | None) -> torch.Tensor:
        channels, height, width = sample.shape[1:]
        packed = pack_latents(sample)
        output = self.module(
            hidden_states=packed, timestep=timestep.to(sample.dtype) / 1000,
            guidance=added["guidance"] if self.module.config.guidance_embeds else None,
            pooled_projections=added["pooled_projections"], encoder_hidden_states=context,
            txt_ids=context.new_zeros(context.shape[1], 3), img_ids=latent_positions(height, width, sample),
            controlnet_block_samples=control.down if control is not None else None,
            controlnet_single_block_samples=(control.single or None) if control is not None else None,
            return_dict=False)[0]
        return unpack_latents(output, channels, height, width)


def denoiser_for(module: UNet2DConditionModel | SD3Transformer2DModel | FluxTransformer2DModel, *,
                 controlled: bool) -> Denoiser:
    """The ``Denoiser`` of ``module``'s kind; ``controlled``: ControlNet residuals will be added."""
    if isinstance(module, SD3Transformer2DModel):
        return SD3Denoiser(module)
    if isinstance(module, FluxTransformer2DModel):
        return FluxDenoiser(module)
    return UNetDenoiser(module, controlled=controlled)
