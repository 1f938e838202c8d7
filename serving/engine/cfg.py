"""Parallel classifier-free guidance: each step the unconditional rows run on a ``CFGWorker`` while the engine
runs the conditional rows. The worker is a second copy of the model on its own device: an in-process engine on a
thread (``LocalCFGWorker``) or a Serve deployment (``serving.deployments.cfg_worker``). A step whose worker fails
is finished by the engine alone; so are the rows a worker answers it did not compute (their LoRAs still loading
there: the engine ``prefetch``es a request's LoRAs on the worker when the request arrives). Once a request is
denoised, the worker's device also decodes the lower half of its image (``band_peer``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
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

    def result(self) -> WorkerNoise: ...


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
