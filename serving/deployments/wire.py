"""What crosses replicas on every denoising step: rows as numpy arrays, conditioning images as object-store
references (``transport``), and the reply the engine waits for after its own share of the step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import ray
from ray.serve.handle import DeploymentResponse

T = TypeVar("T")


@dataclass
class WireRows:
    """``RowBatch`` on its way to the CFG worker: arrays, LoRA names, image references."""

    sample: np.ndarray
    timestep: np.ndarray
    context: np.ndarray
    loras: list[tuple[tuple[str, float], ...]]
    controls: list[tuple[tuple[str, ray.ObjectRef, float], ...]]


@dataclass
class WireCall:
    """``ControlNetCall`` on its way to a ControlNet service: arrays, and references to conditioning images."""

    sample: np.ndarray
    timestep: np.ndarray
    encoder_hidden_states: np.ndarray
    scales: np.ndarray
    images: list[tuple[ray.ObjectRef, int]]


@dataclass
class WireResiduals:
    """A ControlNet's answer: down-block residuals and the mid-block residual."""

    down: list[np.ndarray]
    mid: np.ndarray


class PendingReply(Generic[T]):
    """A deployment call in flight; ``result()`` waits at most ``timeout_s`` and decodes the answer."""

    def __init__(self, response: DeploymentResponse, timeout_s: float, decode: Callable[[object], T]) -> None:
        self._response = response
        self._timeout_s = timeout_s
        self._decode = decode

    def result(self) -> T:
        return self._decode(self._response.result(timeout_s=self._timeout_s))
