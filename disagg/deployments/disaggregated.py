"""The dense side of disaggregated DLRM serving: API, batching, embedding rows fetched from the shards, dense MLPs.

Each batch's ids are deduplicated per table, hot ones answered by the replica's cache, the rest fetched over gRPC
from the shards holding their table slices, all at once (``RemoteEmbeddings``), failing over between a shard's
replicas within ``embedding.lookup_timeout_s``; meanwhile the part of the dense graph that needs no embedding (the
DLRM bottom MLP) runs; the bags are pooled here and feed the rest, on CUDA when present, else CPU. A batch costs
one thread hop (``_forward_batch``). Shard addresses come from the ``ShardDirectory``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from disagg.config import DLRMAppConfig
from disagg.deployments.autoscaling import BUSY_METRIC, BusyFraction, BusyMeter
from disagg.deployments.ingress import BatchedDLRM
from disagg.embedding_cache import EmbeddingCache
from disagg.id_ranges import id_ranges
from disagg.lookup import PreparedBatch, RemoteEmbeddings
from disagg.model_source import model_source
from disagg.partition import EmbeddingLookups, build_dense_part, dense_stages, embedding_lookups
from disagg.rpc.client import EmbeddingClient, ShardClient, ShardStats
from disagg.rpc.tls import channel_credentials
from disagg.tables import shard_version
from serving.common.allocator import REPLICA_RUNTIME_ENV, checks_allocator
from serving.common.constants import EMBEDDING_TOKEN
from serving.common.cpu_share import enforces_replica_share
from serving.common.device import placement, resolve_device, set_torch_threads
from serving.common.logging import get_logger
from serving.common.metrics import Metrics
from serving.common.tensors import register_ray_serializer

logger = get_logger("disagg.deployments.disaggregated")

@serve.deployment(ray_actor_options={"num_cpus": 0.5, "runtime_env": REPLICA_RUNTIME_ENV})
@serve.ingress()
class DisaggregatedDLRM(BatchedDLRM):
    """Dense replica: holds only the MLPs (no table) and asks the embedding shards for pooled embeddings.

    ``shards`` are handles to the shard deployments: binding them here deploys them with this app, and a shard
    the directory knows no address for is asked for one directly.
    """

    @checks_allocator
    @enforces_replica_share
    async def __init__(self, config: DLRMAppConfig | dict[str, Any], directory: DeploymentHandle,
                       shards: list[DeploymentHandle]) -> None:
        self.config = DLRMAppConfig.model_validate(config)
        self.metrics = Metrics.for_replica()
        register_ray_serializer()  # answers to handle callers travel as numpy arrays
        self._busy = BusyMeter()  # time in the dense stages, the autoscaling metric (not time waiting for lookups)
        self._busy_fraction = BusyFraction(self._busy.busy_seconds)
        embedding, model = self.config.embedding, self.config.model
        self.device = resolve_device(model.device)
        set_torch_threads(model.torch_threads)
        source = model_source(model)
        self.signature = source.signature
        partition = await asyncio.to_thread(build_dense_part, source)
        partition.dense_part.to(self.device).eval()
        self._stages = dense_stages(partition)  # what needs no embedding (bottom MLP) runs during the lookup
        self._embedding_inputs = partition.embedding_inputs
        lookups = embedding_lookups(partition)
        self.id_ranges = id_ranges(lookups, self.signature)
        self._embeddings = await asyncio.to_thread(self._remote_embeddings, lookups, source.version_source)
        self._directory, self._shard_handles = directory, shards
        self._apply_batching(self.config.batching)
        await self._wait_for_every_shard(embedding.startup_timeout_s)
        self._discovery = asyncio.create_task(self._discover_forever())
        dense_bytes = sum(t.numel() * t.element_size() for t in partition.dense_part.parameters())
        cache = self._embeddings.cache
        logger.info("DisaggregatedDLRM serving %r: %s seed=%d weights=%s device=%s dense bytes=%s over %d "
                    "shards, wire %s, cache %s %s", self.config.model_name, model.label,
                    model.seed, model.weights_path(), self.device, f"{dense_bytes:,}",
                    embedding.num_shards, embedding.wire_dtype,
                    "off" if cache is None else f"{cache.nbytes:,} bytes {embedding.cache.policy}", placement())

    def _remote_embeddings(self, lookups: EmbeddingLookups, source: str) -> RemoteEmbeddings:
        """The lookup path: shard clients expecting the table versions this replica's config implies (values from
        ``source``, a ``ModelSource.version_source``), the cache."""
        embedding = self.config.embedding
        layout = embedding.layout()
        plan = layout.plan(lookups.tables)
        credentials = channel_credentials(embedding)
        client = EmbeddingClient([
            ShardClient(index, [], input_names=[piece.name for piece in slices],
                        max_message_bytes=embedding.max_message_bytes, credentials=credentials,
                        server_name=embedding.tls_server_name, token=EMBEDDING_TOKEN,
                        expected_version=shard_version(source, slices, layout), packed=True,
                        stream=embedding.transport == "stream", metrics=self.metrics)
            for index, slices in enumerate(plan)
        ])
        cache = embedding.cache
        embeddings = RemoteEmbeddings(
            lookups, plan, client, wire_dtype=embedding.wire_dtype, max_message_bytes=embedding.max_message_bytes,
            cache=EmbeddingCache(lookups.tables, max_bytes=cache.max_bytes, policy=cache.policy, ways=cache.ways)
            if cache.max_bytes else None,
            metrics=self.metrics,
        )
        embeddings.drop_cached_on_new_versions(client)
        self._client = client
        return embeddings

    def ready(self) -> bool:
        """Every shard has at least one known replica."""
        return all(shard.addresses for shard in self._client.shards)

    async def node_id(self) -> str:
        """The Ray node this replica runs on."""
        return ray.get_runtime_context().get_node_id()

    async def shard_addresses(self) -> dict[int, tuple[str, ...]]:
        """The replica addresses this dense replica currently uses, per shard."""
        return {shard.shard_index: shard.addresses for shard in self._client.shards}

    async def embedding_stats(self) -> dict[int, ShardStats]:
        """Per shard: calls, failovers, errors, latencies and bytes each way, since this replica started."""
        return {shard.shard_index: shard.stats for shard in self._client.shards}

    async def _forward_batch(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """One thread hop per batch. On the event loop: dedup and cache, the shard calls sent, and the stage that
        needs no embedding (bottom MLP) while they are answered; then pooling and the rest in a worker thread, so
        the loop prepares the next batch meanwhile. The client's errors carry their HTTP answer (503 for an
        unavailable shard)."""
        if not self.ready():  # a shard lost every replica: look for replacements before giving up on it
            await self._refresh_addresses()
        stages, embeddings = self._stages, self._embeddings
        with self._busy, torch.inference_mode():
            batch = embeddings.prepare({name: inputs[name] for name in self._embedding_inputs})
        fetch = asyncio.ensure_future(embeddings.send(batch, timeout_s=self.config.embedding.lookup_timeout_s))
        try:
            await asyncio.sleep(0)  # one pass of the loop puts the calls on the wire; the bottom MLP runs meanwhile
            early = self._run(stages.early, {name: inputs[name] for name in stages.early_inputs})
        except BaseException:
            fetch.cancel()
            raise
        fetched = await fetch
        return await asyncio.to_thread(self._finish_batch, inputs, batch, fetched, early)

    def _finish_batch(self, inputs: Mapping[str, torch.Tensor], batch: PreparedBatch,
                      fetched: list[torch.Tensor | None], early: Mapping[str, torch.Tensor]) -> Any:
        """Pooling from the fetched rows, then the rest of the dense part."""
        with self._busy, torch.inference_mode():
            pooled = self._embeddings.finish(inputs, batch, fetched)
        available = {**inputs, **early, **pooled}
        return self._run(self._stages.late, {name: available[name] for name in self._stages.late_inputs})

    async def cache_stats(self) -> dict[str, tuple[int, int]]:
        """Per table: hot-embedding cache hits and lookups (unique ids) since this replica started; {} when off."""
        cache = self._embeddings.cache
        return {} if cache is None else cache.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (``BusyTimePolicy``): the share of time since the previous call spent
        in the dense stages."""
        return {BUSY_METRIC: self._busy_fraction.fraction()}

    def _run(self, stage: torch.fx.GraphModule, inputs: dict[str, torch.Tensor]) -> Any:
        with self._busy, torch.inference_mode():
            outputs = stage(**{name: tensor.to(self.device) for name, tensor in inputs.items()})
            if self.device.type == "cuda":  # busy until the kernels finish, not just until they are launched
                torch.cuda.current_stream(self.device).synchronize()
            return outputs

    async def _wait_for_every_shard(self, timeout_s: float) -> None:
        """Until every shard has announced a replica (shards load their tables while this replica starts), at
        most ``timeout_s``; after that the replica starts anyway and is not ready (503) until they come."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            await self._refresh_addresses()
            if self.ready() or asyncio.get_running_loop().time() >= deadline:
                return
            await asyncio.sleep(0.2)

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.embedding.discovery_period_s)
            try:
                await self._refresh_addresses()
            except Exception:  # the directory restarting: keep the addresses we have
                logger.warning("shard directory unreachable; keeping known shard addresses", exc_info=True)

    async def _refresh_addresses(self) -> None:
        known = await self._directory.addresses.remote()
        for shard in self._client.shards:
            addresses = known.get(shard.shard_index, [])
            if not addresses:  # directory restarted empty, or no announcement yet: ask the shard deployment
                with contextlib.suppress(Exception):
                    response = self._shard_handles[shard.shard_index].address.remote()
                    addresses = [await asyncio.wait_for(response, self.config.embedding.discovery_period_s)]
            if tuple(addresses) != shard.addresses:
                logger.info("shard %d replicas: %s", shard.shard_index, ", ".join(addresses) or "none")
                shard.update_addresses(addresses)

    async def __del__(self) -> None:
        discovery = getattr(self, "_discovery", None)
        if discovery is not None:
            discovery.cancel()
            await self._client.close()
