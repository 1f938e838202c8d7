"""Engine-level request and result types, and the backend interface the HTTP layer talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from serving.config import LoRAMode


@dataclass(frozen=True)
class LoRASpec:
    """One LoRA of a request: a registry name and the strength it is applied with."""

    name: str
    scale: float = 1.0


@dataclass(frozen=True, eq=False)
class ControlNetSpec:
    """One ControlNet of a request: its name, the (already decoded and preprocessed) RGB conditioning
    image as uint8 [H, W, 3], and the conditioning scale its residuals are multiplied by."""

    name: str
    image: np.ndarray
    scale: float = 1.0


@dataclass(frozen=True)
class GenerationParams:
    """One validated text-to-image request, in engine terms. Image ``i`` starts from seed ``seed + i``."""

    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    n: int = 1
    negative_prompt: str | None = None
    loras: tuple[LoRASpec, ...] = ()
    controlnets: tuple[ControlNetSpec, ...] = ()
    lora_mode: LoRAMode = "async"

    @property
    def uses_cfg(self) -> bool:
        """Classifier-free guidance runs (two denoiser rows per image) only when the scale exceeds 1, as diffusers."""
        return self.guidance_scale > 1.0

    @property
    def rows(self) -> int:
        """denoiser rows per step: one per image, twice that with classifier-free guidance."""
        return self.n * (2 if self.uses_cfg else 1)


@dataclass(frozen=True)
class LoRAReport:
    """How a request's LoRAs were served: the mode, cache hits, when they took effect, how long it waited."""

    names: tuple[str, ...]
    mode: LoRAMode
    cache_hits: int
    applied_at_step: int | None
    wait_s: float


@dataclass(frozen=True)
class GenerationResult:
    """PNG-encoded images and where the time went (seconds)."""

    images: list[bytes]
    seed: int
    timings: dict[str, float] = field(default_factory=dict)
    lora: LoRAReport | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to validate requests for a model without loading it."""

    name: str
    default_size: int
    size_multiple: int
    family: str = "sd"  # ``serving.presets.ModelFamily``: which LoRAs and ControlNets fit it


class ImageGenerationBackend(ABC):
    """The engine interface the HTTP API talks to: an in-process engine (``LocalBackend``) or a handle to the
    model deployment (``DeploymentBackend``). Refusals raise ``APIError``s."""

    @abstractmethod
    async def model_info(self) -> ModelInfo:
        """The served model's name and image size rules."""

    @abstractmethod
    async def list_loras(self) -> list[str]:
        """The LoRAs a request may name, sorted."""

    @abstractmethod
    async def list_controlnets(self) -> list[str]:
        """The ControlNets a request may name, sorted."""

    @abstractmethod
    async def generate(self, params: GenerationParams) -> GenerationResult:
        """Runs one request to its images."""
