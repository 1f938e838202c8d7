"""Engine-level request and result types, and the backend interface the HTTP layer talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from serving.config import LoRAMode
from serving.engine.emphasis import PromptSyntax


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


@dataclass(frozen=True, eq=False)
class EditImage:
    """What an edit starts from: the RGB image as uint8 [H, W, 3] and an optional mask as uint8 [H, W] (255:
    repaint, 0: keep), both already at the request's size, and ``strength`` in (0, 1]: how far into the noise
    schedule it starts (1.0: from pure noise, as text-to-image, keeping only what the mask keeps)."""

    image: np.ndarray
    mask: np.ndarray | None = None
    strength: float = 0.8


@dataclass(frozen=True)
class GenerationParams:
    """One validated request, in engine terms: text-to-image, or an edit of ``edit``'s image. Image ``i`` starts
    from seed ``seed + i``. ``scheduler``: a name of ``ModelInfo.schedulers`` (None: the model's own).
    ``partial_images``: previews streamed per image while it denoises (0-3). ``prompt_syntax``: ``weighted`` reads
    emphasis in the prompts (``serving.engine.emphasis``), ``plain`` takes them literally. ``true_cfg``: a model
    whose guidance scale is not CFG's (Flux: an embedding; [schnell]: unused), where CFG runs at
    ``true_cfg_scale`` with a negative prompt, as diffusers' ``FluxPipeline`` runs it."""

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
    scheduler: str | None = None
    edit: EditImage | None = None
    partial_images: int = 0
    prompt_syntax: PromptSyntax = "weighted"
    true_cfg: bool = False
    true_cfg_scale: float = 1.0

    @property
    def cfg_scale(self) -> float:
        """The scale the two branches of classifier-free guidance are combined with."""
        return self.true_cfg_scale if self.true_cfg else self.guidance_scale

    @property
    def uses_cfg(self) -> bool:
        """Classifier-free guidance runs (two denoiser rows per image) only when its scale exceeds 1 (a true-CFG
        model: and a negative prompt is given), as diffusers."""
        return self.cfg_scale > 1.0 and (not self.true_cfg or self.negative_prompt is not None)

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
class PartialImage:
    """A preview of image ``image_index`` of a request after denoising step ``step`` (1-based): the request's
    ``partial_index``-th (0-based) of its ``partial_images``, as PNG bytes at the request's size."""

    image_index: int
    partial_index: int
    step: int
    png: bytes


#: What a streamed generation yields: previews, then exactly one ``GenerationResult`` last.
GenerationEvent = PartialImage | GenerationResult


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to validate requests for a model without loading it."""

    name: str
    default_size: int
    size_multiple: int
    family: str = "sd"  # ``serving.presets.ModelFamily``: which LoRAs and ControlNets fit it
    schedulers: tuple[str, ...] = ()  # what a request's ``scheduler`` may name
    default_scheduler: str = ""  # the model's own scheduler, used when a request names none
    true_cfg: bool = False  # CFG at ``true_cfg_scale`` (Flux), not at ``guidance_scale``


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
        """Runs one request to its images. Cancelling the call cancels the request: it takes no further step."""

    @abstractmethod
    def generate_stream(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """Runs one request, yielding its ``PartialImage`` previews as they are decoded and its result last.
        Closing the iterator early (a client that went away) cancels the request."""
