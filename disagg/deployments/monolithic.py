"""Monolithic DLRM baseline: the whole model and the OIP v2 API in one Ray Serve deployment.

With ``model.stacked_tables`` (the default) the model is cut after its lookups (``partition_embeddings``) and each
row width's tables live in one tensor, so a batch pools every bag in one ``embedding_bag`` call instead of one call
per table; the outputs are the model's own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from ray import serve

from disagg.config import DLRMAppConfig
from disagg.deployments.ingress import MODEL_INPUTS, BatchedDLRM
from disagg.id_space import stack_tables
from disagg.model import build_preset
from disagg.partition import Partition, embedding_lookups, partition_embeddings
from serving.common.cpu_share import enforces_replica_share
from serving.common.device import placement, resolve_device, set_torch_threads
from serving.common.logging import get_logger
from serving.common.metrics import Metrics

logger = get_logger("disagg.deployments.monolithic")


@serve.deployment(ray_actor_options={"num_cpus": 0.5})
@serve.ingress()
class MonolithicDLRM(BatchedDLRM):
    """One replica holds the full DLRM (every table and the MLPs); requests are batched across callers."""

    @enforces_replica_share
    def __init__(self, config: DLRMAppConfig | dict[str, Any]) -> None:
        self.config = DLRMAppConfig.model_validate(config)
        self.metrics = Metrics.for_replica()
        self.device = resolve_device(self.config.model.device)
        set_torch_threads(self.config.model.torch_threads)
        model = self.config.model
        self.model = build_preset(model.preset, seed=model.seed, weights=model.weights_path()).to(self.device).eval()
        self.spec = self.model.spec
        self._partition: Partition | None = None
        if model.stacked_tables:
            self._partition = partition_embeddings(self.model)
            self._lookups = embedding_lookups(self._partition)
            self._tables = stack_tables(self.model, self._lookups.space)
        self._apply_batching(self.config.batching)
        logger.info(
            "MonolithicDLRM serving %r: preset=%s seed=%d weights=%s device=%s params=%s max_batch_size=%d "
            "batch_wait_timeout_s=%g stacked_tables=%s %s",
            self.config.model_name, self.config.model.preset, self.config.model.seed, model.weights_path(), self.device,
            f"{sum(p.numel() for p in self.model.parameters()):,}", self.config.batching.max_batch_size,
            self.config.batching.batch_wait_timeout_s, model.stacked_tables, placement(),
        )

    async def _forward_batch(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        # In a worker thread so the event loop keeps parsing and validating the requests of the next batch.
        return await asyncio.to_thread(self._forward, dense, sparse)

    def _forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            if self._partition is None:
                return self.model(dense.to(self.device), sparse.to(self.device)).cpu()
            inputs = dict(zip(MODEL_INPUTS, (dense.to(self.device), sparse.to(self.device)), strict=True))
            part = self._partition
            cut = self._lookups.pool_tables({name: inputs[name] for name in part.embedding_inputs}, self._tables)
            return part.dense_part(**{name: inputs[name] for name in part.dense_inputs}, **cut).cpu()
