"""Per-request denoising state: its own scheduler, latents, embeddings, LoRAs and timings."""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from diffusers import SchedulerMixin

from serving.engine.types import GenerationParams
from serving.lora.weights import LoRAWeights


@dataclass(frozen=True)
class TextEmbeddings:
    """What one prompt conditions the denoiser on, a row per image: text states [n, S, D] and its added inputs by
    name (SDXL's ``text_embeds`` [n, P] and ``time_ids`` [n, 6]; SD3's ``pooled_projections`` [n, P])."""

    hidden: torch.Tensor
    added: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PendingLoRA:
    """A LoRA the request asked for: its load (possibly still running) and the strength to apply it at."""

    name: str
    scale: float
    load: Future[LoRAWeights]
    cache_hit: bool


@dataclass
class LoRAActivation:
    """A request's LoRAs made ready off the denoising thread: device copies, and text embeddings re-encoded with
    them (``None`` when none touches the text encoder)."""

    loras: list[tuple[LoRAWeights, float]]
    embeds: tuple[TextEmbeddings, TextEmbeddings | None] | None


@dataclass(frozen=True)
class Inpainting:
    """What an inpainting request puts back after each scheduler step, as diffusers' inpainting pipelines do with a
    4-channel denoiser: the kept region of the source image's latents [n, C, h, w], noised to the next timestep with
    the request's initial noise [n, C, h, w]. ``mask`` [n, 1, h, w] is 1 where the image is repainted, 0 where kept."""

    image_latents: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor


@dataclass
class RequestState:
    """Everything one request carries between denoising steps. Owned by the engine loop thread."""

    params: GenerationParams
    scheduler: SchedulerMixin
    timesteps: torch.Tensor
    latents: torch.Tensor  # [n, C, h, w]
    generators: list[torch.Generator]
    prompt_embeds: TextEmbeddings
    negative_embeds: TextEmbeddings | None  # when CFG runs
    lora_step: int  # the step at which the request stops and waits for its LoRAs
    controls: list[tuple[str, torch.Tensor, float]] = field(default_factory=list)  # name, [1,3,H,W], scale
    loras: list[PendingLoRA] = field(default_factory=list)
    active_loras: list[tuple[LoRAWeights, float]] = field(default_factory=list)
    lora_activation: Future[LoRAActivation] | None = None  # ``prepare_loras`` on the stage thread, once loaded
    step_index: int = 0
    lora_applied_at: int | None = None
    lora_wait_s: float = 0.0
    blocked_since: float | None = None
    admitted: float = field(default_factory=time.perf_counter)  # joined the engine loop
    denoised: float | None = None  # took its last step
    x0_estimate: torch.Tensor | None = None  # the scheduler's prediction of the clean latents at the last step
    # (``pred_original_sample``; inpainting: the source's latents where the mask keeps them), None where it has none
    inpainting: Inpainting | None = None  # an inpainting request's kept region, blended in after each step
    denoiser_inputs: torch.Tensor | None = None  # channels after each row's latents (an inpainting denoiser's mask
    # and masked-image latents) [rows, c, h, w]
    long_text: int | None = None  # text tokens per row when a long prompt made them more than the model's usual
    _context: tuple[torch.Tensor, dict[str, torch.Tensor], TextEmbeddings, TextEmbeddings | None] | None = field(
        default=None, init=False, repr=False)  # (context, added, the prompt and negative embeddings they came from)

    @property
    def context(self) -> torch.Tensor:
        """The text embeddings of every row [rows, S, D] (with CFG the negative ones first): one tensor until the
        embeddings are replaced (LoRAs re-encoding the text), so a remote worker is sent it once."""
        return self._rows()[0]

    @property
    def added(self) -> dict[str, torch.Tensor]:
        """The denoiser's added inputs of every row, in the order of ``context`` (empty for a denoiser without them)."""
        return self._rows()[1]

    def _rows(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        built = self._context
        if built is None or built[2] is not self.prompt_embeds or built[3] is not self.negative_embeds:
            prompt, negative = self.prompt_embeds, self.negative_embeds
            if negative is None:
                context, added = prompt.hidden, dict(prompt.added)
            else:
                context = torch.cat([negative.hidden, prompt.hidden])
                added = {name: torch.cat([negative.added[name], value]) for name, value in prompt.added.items()}
            built = self._context = (context, added, prompt, negative)
        return built[0], built[1]

    @property
    def preview_latents(self) -> torch.Tensor:
        """What a preview of the request shows now: the last step's clean-latent estimate where the scheduler gives
        one, else the current latents [n, C, h, w]."""
        return self.x0_estimate if self.x0_estimate is not None else self.latents

    @property
    def done(self) -> bool:
        return self.step_index >= len(self.timesteps)

    @property
    def loras_pending(self) -> bool:
        return bool(self.loras) and not self.active_loras

    @property
    def loras_loaded(self) -> bool:
        """Every LoRA load has finished (or failed)."""
        return all(pending.load.done() for pending in self.loras)

    @property
    def failed_lora(self) -> PendingLoRA | None:
        """The first LoRA whose (finished) load failed, if any."""
        return next((p for p in self.loras if p.load.done() and p.load.exception() is not None), None)

    @property
    def loras_ready_to_prepare(self) -> bool:
        """Every LoRA loaded, none failed."""
        return bool(self.loras) and self.loras_loaded and self.failed_lora is None

    @property
    def blocked(self) -> bool:
        """Reached its LoRA deadline step without its LoRAs: it must not step until they are applied."""
        return self.loras_pending and self.step_index >= self.lora_step

    @property
    def rows(self) -> int:
        return self.params.rows

    @property
    def steps_left(self) -> int:
        return len(self.timesteps) - self.step_index

    @property
    def size(self) -> tuple[int, int]:
        return self.params.height, self.params.width

    @property
    def batch_key(self) -> tuple[int, ...]:
        """What requests sharing a denoiser forward must have in common: the image size, and the text length when
        a long prompt changed it."""
        return self.size if self.long_text is None else (*self.size, self.long_text)
