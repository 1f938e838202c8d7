"""Merging concurrent requests' rows into one forward pass and handing each caller its own rows back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from disagg.api.protocol import EMPTY_SLOT


class MergedBatch(NamedTuple):
    """Row-wise concatenation of several requests' inputs and each request's row count, in order."""

    dense: torch.Tensor
    sparse: torch.Tensor
    row_counts: list[int]


def merge_requests(requests: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> MergedBatch:
    """Concatenates the (dense [B, F], sparse [B, T, H]) pairs of ``requests`` along the batch dimension.

    Requests with fewer ids per bag (H) are padded with empty slots (-1) to the batch's largest H, which
    leaves their sum-pooled bags unchanged.
    """
    if not requests:
        raise ValueError("cannot merge an empty list of requests")
    dense = torch.cat([dense for dense, _ in requests])
    hotness = max(sparse.shape[2] for _, sparse in requests)
    sparse = torch.cat([F.pad(sparse, (0, hotness - sparse.shape[2]), value=EMPTY_SLOT) for _, sparse in requests])
    return MergedBatch(dense, sparse, [request_dense.shape[0] for request_dense, _ in requests])


def split_rows(outputs: torch.Tensor, row_counts: Sequence[int]) -> list[torch.Tensor]:
    """Inverse of ``merge_requests`` for the batched output: one tensor per request, in request order."""
    if outputs.shape[0] != sum(row_counts):
        raise ValueError(f"output has {outputs.shape[0]} rows but the requests hold {sum(row_counts)}")
    return list(torch.split(outputs, list(row_counts)))
