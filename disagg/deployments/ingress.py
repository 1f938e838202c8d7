"""What both DLRM ingress deployments share: the OIP v2 API, batching across requests, live batching changes."""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI
from ray import serve

from disagg.api.server import create_oip_api
from disagg.config import BatchingConfig, DLRMAppConfig
from disagg.deployments.batching import merge_requests, split_rows
from disagg.model import DLRMSpec
from serving.common.constants import API_KEY
from serving.common.logging import get_logger
from serving.common.memory import MemoryReport
from serving.common.metrics import NO_METRICS, Metrics

logger = get_logger("disagg.deployments.ingress")


class BatchedDLRM(MemoryReport):
    """Base of the DLRM deployments: concurrent requests are merged into one ``_forward_batch`` (``@serve.batch``);
    two batches may be in flight, so one's embedding lookups (or validation) overlap the other's forward.

    Subclasses set ``config``, ``spec`` and ``metrics``, call ``_apply_batching`` once, and implement
    ``_forward_batch``. ``reconfigure`` takes a ``BatchingConfig``-shaped Serve ``user_config`` to change batching
    without restart.
    """

    config: DLRMAppConfig
    spec: DLRMSpec
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

    async def _forward_batch(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Probabilities [B, 1] for a merged batch; runs heavy work off the event loop."""
        raise NotImplementedError
