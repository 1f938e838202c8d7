"""The base of both DLRM ingress deployments: the OIP v2 API, requests merged into one batch and results split back."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from fastapi import FastAPI
from ray import serve

from disagg.api.backend import DLRMBackend
from disagg.api.protocol import EMPTY_SLOT
from disagg.api.server import create_oip_api
from disagg.config import BatchingConfig, DLRMAppConfig
from serving.common.constants import API_KEY
from serving.common.logging import get_logger
from serving.common.memory import MemoryReport
from serving.common.metrics import NO_METRICS, Metrics

logger = get_logger("disagg.deployments.ingress")

#: Parameter names of ``DLRM.forward``: the model inputs each part of a partition asks for by name.
MODEL_INPUTS = ("dense", "sparse")


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


class BatchedDLRM(DLRMBackend, MemoryReport):
    """A ``DLRMBackend`` deployment: concurrent requests are merged into one ``_forward_batch`` (``@serve.batch``);
    two batches may be in flight, so one's embedding lookups (or validation) overlap the other's forward.

    Subclasses set ``spec``, ``config`` and ``metrics`` and call ``_apply_batching`` in their constructor;
    ``reconfigure`` takes a ``BatchingConfig``-shaped Serve ``user_config`` to change batching without a restart.
    """

    #: The application this replica serves.
    config: DLRMAppConfig
    #: Where request latencies and batch sizes go.
    metrics: Metrics = NO_METRICS

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_oip_api(self, self.config, api_key=API_KEY)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies a new ``BatchingConfig`` (Ray Serve ``user_config``) to the running replica."""
        batching = BatchingConfig.model_validate(user_config)
        self._apply_batching(batching)
        logger.info("%s batching now max_batch_size=%d batch_wait_timeout_s=%g", type(self).__name__,
                    batching.max_batch_size, batching.batch_wait_timeout_s)

    def _apply_batching(self, batching: BatchingConfig) -> None:
        self._infer_batch.set_max_batch_size(batching.max_batch_size)
        self._infer_batch.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)

    def ready(self) -> bool:
        return True

    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Probabilities [B, 1] for one request, computed in a batch with whatever else is waiting."""
        with self.metrics.request("dlrm_infer"):
            return await self._infer_batch((dense, sparse))

    @serve.batch(max_concurrent_batches=2)  # the next batch's lookups or parsing overlap this batch's compute
    async def _infer_batch(self, requests: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        merged = merge_requests(requests)
        self.metrics.dlrm_batch(merged.dense.shape[0])
        return split_rows(await self._forward_batch(merged.dense, merged.sparse), merged.row_counts)

    @abc.abstractmethod
    async def _forward_batch(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Probabilities [B, 1] for a merged batch; runs heavy work off the event loop."""
