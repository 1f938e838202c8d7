"""The engine interface the OIP v2 API talks to: one replica running the whole model, or split CPU/GPU pools."""

from __future__ import annotations

import abc
from collections.abc import Mapping

import torch

from disagg.id_ranges import IdRange
from disagg.signature import ModelSignature


class DLRMBackend(abc.ABC):
    """Runs one recommendation model (a DLRM preset or a user model) on validated tensors."""

    #: The served tensors: wire names, types and shapes, the ``forward`` argument each input feeds.
    signature: ModelSignature
    #: Valid ids of each integer input the model looks up, by wire name (``disagg.id_ranges.id_ranges``).
    id_ranges: Mapping[str, IdRange]

    @abc.abstractmethod
    async def infer(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The outputs (signature order, batch first) of one request's ``inputs``, keyed by ``forward`` argument,
        each of its signature's shape and type (its variable dimensions may differ between calls)."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether ``infer`` can succeed now (e.g. every embedding shard has a replica)."""
