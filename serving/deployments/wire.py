"""What crosses replicas on every denoising step: rows as numpy arrays, a request's text embeddings and
conditioning images as object-store references (``transport``: put once per request), and the reply the engine
waits for after its own share of the step. ``nbytes``: what a step's message moves besides those references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import ray
from ray.serve.handle import DeploymentResponse

T = TypeVar("T")

#: A row's text embedding: a reference to its request's embeddings [rows, S, D] and its index in them.
WireContextRow = tuple[ray.ObjectRef, int]


@dataclass
class WireRows:
    """``RowBatch`` on its way to the CFG worker: arrays, embedding references, LoRA names, image references."""

    sample: np.ndarray
    timestep: np.ndarray
    context: list[WireContextRow]
    context_length: int  # text tokens per row: rows share a forward only with rows of the same length
    loras: list[tuple[tuple[str, float], ...]]
    controls: list[tuple[tuple[str, ray.ObjectRef, float], ...]]
    added: dict[str, np.ndarray] = field(default_factory=dict)  # the denoiser's added inputs per row (SDXL, SD3)

    @property
    def rows(self) -> int:
        return self.sample.shape[0]

    @property
    def nbytes(self) -> int:
        return self.sample.nbytes + self.timestep.nbytes + sum(value.nbytes for value in self.added.values())


@dataclass
class WireNoise:
    """The CFG worker's answer: the noise of the rows it computed, and the rows it skipped (LoRAs still loading)."""

    noise: np.ndarray  # [computed rows, C, h, w]
    skipped: list[int]

    @property
    def nbytes(self) -> int:
        return self.noise.nbytes


@dataclass
class WireCall:
    """``ControlNetCall`` on its way to a ControlNet service: arrays, references to embeddings and images."""

    sample: np.ndarray
    timestep: np.ndarray
    context: list[WireContextRow]
    context_length: int  # text tokens per row: calls share a forward only with calls of the same length
    scales: np.ndarray
    images: list[tuple[ray.ObjectRef, int]]
    added: dict[str, np.ndarray] = field(default_factory=dict)  # the added inputs per row (SDXL, SD3)
    latent_shift: float = 0.0  # SD3: the VAE shift taken out of the images' latents

    @property
    def nbytes(self) -> int:
        return (self.sample.nbytes + self.timestep.nbytes + self.scales.nbytes
                + sum(value.nbytes for value in self.added.values()))


@dataclass
class WireResiduals:
    """A ControlNet's answer: down-block residuals and the mid-block residual (SD3: block samples, no mid; Flux:
    block samples and single-block samples)."""

    down: list[np.ndarray]
    mid: np.ndarray | None
    single: list[np.ndarray] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return (sum(block.nbytes for block in self.down) + (self.mid.nbytes if self.mid is not None else 0)
                + sum(block.nbytes for block in self.single))


class PendingReply(Generic[T]):
    """A deployment call in flight; ``result()`` waits at most ``timeout_s`` (or less when asked) and decodes the
    answer."""

    def __init__(self, response: DeploymentResponse, timeout_s: float, decode: Callable[[object], T]) -> None:
        self._response = response
        self._timeout_s = timeout_s
        self._decode = decode

    def result(self, timeout: float | None = None) -> T:
        timeout_s = self._timeout_s if timeout is None else min(timeout, self._timeout_s)
        return self._decode(self._response.result(timeout_s=timeout_s))

    def cancel(self) -> bool:
        self._response.cancel()
        return True
