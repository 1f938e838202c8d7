"""Parallel classifier-free guidance: each step the unconditional rows run on a ``CFGWorker`` while the engine
runs the conditional rows. The worker is a second copy of the model on its own device: an in-process engine on a
thread (``LocalCFGWorker``) or a Serve deployment (``serving.deployments.cfg_worker``). A step whose worker fails
is finished by the engine alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from serving.engine.rows import RowBatch

if TYPE_CHECKING:
    from serving.engine.denoiser import DiffusionEngine


class PendingNoise(Protocol):
    """A CFG worker's step in flight: a ``Future``, or a Serve deployment's reply."""

    def result(self) -> torch.Tensor: ...


class CFGWorker(ABC):
    """Predicts the noise of the rows an engine hands off, on a second copy of its model."""

    @abstractmethod
    def submit(self, batch: RowBatch) -> PendingNoise:
        """Starts the UNet's noise prediction for every row of ``batch``."""


class LocalCFGWorker(CFGWorker):
    """A second engine in this process, on its own thread (and device, when given one)."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cfg-worker")

    def submit(self, batch: RowBatch) -> PendingNoise:
        moved = batch.to(self.engine.device)
        moved.loras = [tuple((self.engine.lora_on_device(weights), scale) for weights, scale in row)
                       for row in moved.loras]
        return self._pool.submit(self.engine.predict_noise, moved)

    def close(self) -> None:
        self._pool.shutdown()
