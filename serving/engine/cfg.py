"""Parallel classifier-free guidance: the unconditional rows of a step run on a second worker.

Each step the engine cuts the unconditional rows out of the batch, sends them to the worker, runs
the conditional rows itself meanwhile, and combines both predictions into the guided noise before
stepping each request's scheduler. The worker is a second copy of the model on its own device: an
in-process engine on a thread (``LocalCFGWorker``) or a Serve deployment (``serving.deployments.model``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from serving.engine.rows import RowBatch

if TYPE_CHECKING:
    from serving.engine.denoiser import DiffusionEngine


class CFGWorkerUnavailable(RuntimeError):
    """The CFG worker did not answer a step (its replica died, timed out, or raised)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"CFG worker is unavailable: {type(cause).__name__}: {cause}")


class PendingNoise(Protocol):
    def result(self) -> torch.Tensor: ...


class CFGWorker(Protocol):
    def submit(self, batch: RowBatch) -> PendingNoise: ...


class LocalCFGWorker:
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
