"""The engine interface the OIP v2 API talks to: one replica running the whole model, or split CPU/GPU pools."""

from __future__ import annotations

import abc

import torch

from disagg.spec import DLRMSpec


class DLRMBackend(abc.ABC):
    """Runs a DLRM of architecture ``spec`` on validated tensors."""

    #: Architecture of the served model: input widths and embedding table sizes.
    spec: DLRMSpec

    @abc.abstractmethod
    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Probabilities [B, 1] for ``dense`` float32 [B, num_dense] and ``sparse`` int64 [B, num_tables, H]
        (-1: empty slot; H may differ between calls)."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether ``infer`` can succeed now (e.g. every embedding shard has a replica)."""
