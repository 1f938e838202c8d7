"""Loaded LoRA weights, unmerged: per targeted module, the two low-rank factors and their scale."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class LoRALayer:
    """One module's LoRA: ``delta_W = scale * up @ down`` (flattened over the kernel for convolutions).

    Compared and hashed by identity, like the tensors it holds.
    """

    down: torch.Tensor  # "A": [r, in_features] for nn.Linear targets; [r, in_ch, kh, kw] for nn.Conv2d targets
    up: torch.Tensor  # "B": [out_features, r] for Linear; [out_ch, r, 1, 1] for Conv2d
    scale: float  # alpha / r for this module (diffusers/PEFT convention); the request's scale multiplies it later

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.down) + _nbytes(self.up)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> LoRALayer:
        return LoRALayer(down=self.down.to(device, dtype), up=self.up.to(device, dtype), scale=self.scale)


@dataclass(frozen=True, eq=False)
class LoRAWeights:
    """A LoRA file, validated against one model: layers keyed by exact ``named_modules()`` names (by identity), per
    component: the denoiser (a UNet, or SD3's transformer), the text encoder, and SDXL's or SD3's second CLIP text
    encoder (``text_encoder_2``)."""

    name: str
    denoiser: Mapping[str, LoRALayer]
    text_encoder: Mapping[str, LoRALayer]
    nbytes: int  # bytes of all tensors
    text_encoder_2: Mapping[str, LoRALayer] = field(default_factory=dict)

    @classmethod
    def build(cls, name: str, denoiser: Mapping[str, LoRALayer], text_encoder: Mapping[str, LoRALayer],
              text_encoder_2: Mapping[str, LoRALayer] | None = None) -> LoRAWeights:
        """Weights with ``nbytes`` computed from the layers."""
        text_encoder_2 = text_encoder_2 or {}
        nbytes = sum(layer.nbytes for layers in (denoiser, text_encoder, text_encoder_2) for layer in layers.values())
        return cls(name=name, denoiser=dict(denoiser), text_encoder=dict(text_encoder), nbytes=nbytes,
                   text_encoder_2=dict(text_encoder_2))

    @property
    def targets_text(self) -> bool:
        """Whether it changes a text encoder (the prompt's embeddings)."""
        return bool(self.text_encoder or self.text_encoder_2)

    @property
    def modules(self) -> int:
        """Modules it targets, over every component."""
        return len(self.denoiser) + len(self.text_encoder) + len(self.text_encoder_2)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> LoRAWeights:
        """A copy on ``device`` (and in ``dtype`` if given); ``self`` is left untouched."""
        return LoRAWeights.build(
            self.name,
            *({key: layer.to(device, dtype) for key, layer in layers.items()}
              for layers in (self.denoiser, self.text_encoder, self.text_encoder_2)),
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
