"""Monolithic serving: the whole model (a DLRM preset or a user model) and the OIP v2 API in one Ray Serve deployment.

With ``model.stacked_tables`` (the default) the model is cut after its lookups (``partition_embeddings``) and each
row width's tables live in one tensor, so a batch pools every bag in one ``embedding_bag`` call instead of one call
per table; the outputs are the model's own. A model whose lookups cannot be stacked (functional lookups) runs as is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import torch
from ray import serve

from disagg.config import DLRMAppConfig
from disagg.deployments.ingress import BatchedDLRM
from disagg.id_ranges import id_ranges
from disagg.id_space import stack_tables
from disagg.model_source import model_source
from disagg.partition import embedding_lookups, partition_embeddings
from serving.common.allocator import REPLICA_RUNTIME_ENV, checks_allocator
from serving.common.cpu_share import enforces_replica_share
from serving.common.device import placement, resolve_device, set_torch_threads
from serving.common.logging import get_logger
from serving.common.metrics import Metrics
from serving.common.tensors import register_ray_serializer

logger = get_logger("disagg.deployments.monolithic")


@serve.deployment(ray_actor_options={"num_cpus": 0.5, "runtime_env": REPLICA_RUNTIME_ENV})
@serve.ingress()
class MonolithicDLRM(BatchedDLRM):
    """One replica holds the whole model (every table and the dense layers); requests are batched across callers."""

    @checks_allocator
    @enforces_replica_share
    def __init__(self, config: DLRMAppConfig | dict[str, Any]) -> None:
        self.config = DLRMAppConfig.model_validate(config)
        self.metrics = Metrics.for_replica()
        register_ray_serializer()  # answers to handle callers travel as numpy arrays
        self.device = resolve_device(self.config.model.device)
        set_torch_threads(self.config.model.torch_threads)
        model = self.config.model
        source = model_source(model)
        self.signature = source.signature
        self.model = source.build().to(self.device).eval()
        try:
            self._partition = partition_embeddings(self.model)
            self._lookups = embedding_lookups(self._partition)
        except Exception as exc:  # untraceable forward, functional lookups: nothing to stack, no id ranges to check
            logger.info("MonolithicDLRM runs %s as is (%s); ids are checked by its own lookups", model.label, exc)
            self._lookups = None
        self.id_ranges = {} if self._lookups is None else id_ranges(self._lookups, self.signature)
        self._tables = None
        if model.stacked_tables and self._lookups is not None:
            self._tables = stack_tables(self.model, self._lookups.space)
        self._apply_batching(self.config.batching)
        logger.info(
            "MonolithicDLRM serving %r: %s seed=%d weights=%s device=%s params=%s max_batch_size=%d "
            "batch_wait_timeout_s=%g stacked_tables=%s %s",
            self.config.model_name, model.label, model.seed, model.weights_path(), self.device,
            f"{sum(p.numel() for p in self.model.parameters()):,}", self.config.batching.max_batch_size,
            self.config.batching.batch_wait_timeout_s, self._tables is not None, placement(),
        )

    async def _forward_batch(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        # In a worker thread so the event loop keeps parsing and validating the requests of the next batch.
        return await asyncio.to_thread(self._forward, inputs)

    def _forward(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        with torch.inference_mode():
            inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
            if self._tables is None:
                return self.model(**inputs)
            part, lookups = self._partition, self._lookups
            assert lookups is not None  # tables are stacked only with lookups
            cut = lookups.pool_tables({name: inputs[name] for name in part.embedding_inputs}, self._tables)
            return part.dense_part(**{name: inputs[name] for name in part.dense_inputs}, **cut)
