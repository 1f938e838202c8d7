"""Parallel classifier-free guidance: each step the unconditional rows run on a ``CFGWorker`` while the engine
runs the conditional rows. The worker is a second copy of the model on its own device: an in-process engine on a
thread (``LocalCFGWorker``) or a Serve deployment (``serving.deployments.cfg_worker``). A step whose worker fails
is finished by the engine alone; so are the rows a worker answers it did not compute (their LoRAs still loading
there: the engine ``prefetch``es a request's LoRAs on the worker when the request arrives), and so is a step whose
worker is late (``WorkerPatience``: a dead worker's calls may wait in Serve's queue for its replacement). Once a
request is denoised, the worker's device also decodes the lower half of its image (``band_peer``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from serving.engine.band_decode import BOTTOM, BandPeer, GeneratorBandPeer, decode_band
from serving.engine.rows import RowBatch

if TYPE_CHECKING:
    from serving.engine.diffusion_engine import DiffusionEngine


@dataclass
class WorkerNoise:
    """A CFG worker's answer: the noise of the rows it computed, and which rows it left to the engine."""

    noise: torch.Tensor  # [computed rows, C, h, w], in row order
    skipped: list[int]  # rows of the batch not computed, in order


class PendingNoise(Protocol):
    """A CFG worker's step in flight: a ``Future``, or a Serve deployment's reply."""

    def result(self, timeout: float | None = None) -> WorkerNoise:
        """The answer, waiting at most ``timeout`` seconds (None: the call's own deadline); raises past it."""

    def cancel(self) -> bool:
        """Gives the call up (its answer, if one still comes, is dropped)."""


class WorkerPatience:
    """How long an engine relies on its CFG worker. After its own rows of a step it waits for the worker's at most
    ``patience`` times as long as its own took, at least ``min_wait_s``. After a failure (an error or that wait
    passed) the worker is not ``available`` for ``retry_after_s``, doubled per failure in a row up to
    ``max_retry_after_s``; an answer resets it. Used from the engine's one thread."""

    def __init__(self, patience: float = 4.0, min_wait_s: float = 0.5, retry_after_s: float = 1.0,
                 max_retry_after_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if patience <= 0 or min_wait_s < 0 or retry_after_s <= 0 or max_retry_after_s < retry_after_s:
            raise ValueError("patience and retry_after_s must be > 0, min_wait_s >= 0, "
                             "max_retry_after_s >= retry_after_s")
        self._patience, self._min_wait_s = patience, min_wait_s
        self._retry_after_s, self._max_retry_after_s = retry_after_s, max_retry_after_s
        self._clock = clock
        self._failures = 0
        self._retry_at = -float("inf")

    def available(self) -> bool:
        """Whether to call the worker now (False while pausing after a failure)."""
        return self._clock() >= self._retry_at

    def wait_s(self, own_s: float) -> float:
        """How long to wait for the worker's rows once the engine's own took ``own_s`` seconds."""
        return max(self._min_wait_s, self._patience * own_s)

    def failed(self) -> float:
        """Records a failure; the seconds until the worker is called again."""
        pause = min(self._max_retry_after_s, self._retry_after_s * 2 ** min(self._failures, 32))
        self._failures += 1
        self._retry_at = self._clock() + pause
        return pause

    def answered(self) -> None:
        """Records an answer: the next failure pauses ``retry_after_s`` again."""
        self._failures = 0


class CFGWorker(ABC):
    """Predicts the noise of the rows an engine hands off, on a second copy of its model."""

    @abstractmethod
    def submit(self, batch: RowBatch) -> PendingNoise:
        """Starts the denoiser's prediction for the rows of ``batch``; it may skip rows whose LoRAs it has not
        loaded yet."""

    def prefetch(self, names: Sequence[str]) -> None:  # noqa: B027 (no-op: a worker using the engine's LoRAs)
        """Starts loading LoRAs a request arriving now will use; returns at once."""

    @abstractmethod
    def band_peer(self, latents: torch.Tensor) -> BandPeer:
        """Starts the bottom band of the VAE decode of ``latents`` (scaled as ``vae.decode`` takes them) on the
        worker's device (``serving.engine.band_decode``)."""


class LocalCFGWorker(CFGWorker):
    """A second engine in this process, on its own thread (and device, when given one)."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfg-worker")

    def submit(self, batch: RowBatch) -> PendingNoise:
        moved = batch.to(self.engine.device)
        moved.loras = [tuple((self.engine.lora_on_device(weights), scale) for weights, scale in row)
                       for row in moved.loras]
        return self._pool.submit(lambda: WorkerNoise(self.engine.predict_noise(moved), []))

    def band_peer(self, latents: torch.Tensor) -> BandPeer:
        device = self.engine.device
        return GeneratorBandPeer(decode_band(self.engine.vae, latents.to(device), BOTTOM), self._pool, device)

    def close(self) -> None:
        self._pool.shutdown()
