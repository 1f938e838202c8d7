"""Monolithic DLRM baseline: the whole model and the OIP v2 API in one Ray Serve deployment."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from fastapi import FastAPI
from ray import serve

from disagg.api import create_oip_api
from disagg.batching import merge_requests, split_rows
from disagg.config import BatchingConfig, DLRMAppConfig
from disagg.model import build_preset
from serving.common.device import placement, resolve_device
from serving.common.logging import get_logger

logger = get_logger("disagg.monolithic")


@serve.deployment(ray_actor_options={"num_cpus": 0.5})
@serve.ingress()
class MonolithicDLRM:
    """One replica holds the full DLRM; concurrent requests are merged into one forward (``@serve.batch``).

    ``reconfigure`` takes a ``BatchingConfig``-shaped ``user_config`` to change batching without restart.
    """

    def __init__(self, config: DLRMAppConfig | dict[str, Any]) -> None:
        self.config = DLRMAppConfig.model_validate(config)
        self.device = resolve_device(self.config.model.device)
        model = build_preset(self.config.model.preset, seed=self.config.model.seed)
        self.model = model.to(self.device).eval()
        self.spec = self.model.spec
        self._apply_batching(self.config.batching)
        logger.info(
            "MonolithicDLRM serving %r: preset=%s seed=%d device=%s params=%s max_batch_size=%d "
            "batch_wait_timeout_s=%g %s",
            self.config.model_name, self.config.model.preset, self.config.model.seed, self.device,
            f"{sum(p.numel() for p in self.model.parameters()):,}", self.config.batching.max_batch_size,
            self.config.batching.batch_wait_timeout_s, placement(),
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_oip_api(self, self.config)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies a new ``BatchingConfig`` (Ray Serve ``user_config``) to the running replica."""
        batching = BatchingConfig.model_validate(user_config)
        self._apply_batching(batching)
        logger.info("MonolithicDLRM batching now max_batch_size=%d batch_wait_timeout_s=%g",
                    batching.max_batch_size, batching.batch_wait_timeout_s)

    def _apply_batching(self, batching: BatchingConfig) -> None:
        self._infer_batch.set_max_batch_size(batching.max_batch_size)
        self._infer_batch.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)

    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Probabilities [B, 1] for one request, computed in a batch with whatever else is waiting."""
        return await self._infer_batch((dense, sparse))

    @serve.batch
    async def _infer_batch(self, requests: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        merged = merge_requests(requests)
        # In a worker thread so the event loop keeps parsing and validating the requests of the next batch.
        probabilities = await asyncio.to_thread(self._forward, merged.dense, merged.sparse)
        return split_rows(probabilities, merged.row_counts)

    def _forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(dense.to(self.device), sparse.to(self.device)).cpu()
