"""Embedding shards on Ray Serve: each replica runs a gRPC ``EmbeddingServer`` (with the TLS and token
``embedding`` asks for) and announces its address to the ``ShardDirectory`` at start and on every health check;
an address not announced for ``ttl_s`` is dropped. Placement is Serve's: give shards resources only CPU nodes have.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from disagg.config import DLRMAppConfig
from disagg.deployments.autoscaling import BUSY_METRIC, BusyFraction
from disagg.model_source import model_source
from disagg.rpc.server import EmbeddingServer, exposure_problem, host_port
from disagg.rpc.tls import server_tls
from disagg.tables import build_embedding_shard
from serving.common.allocator import REPLICA_RUNTIME_ENV, checks_allocator
from serving.common.constants import EMBEDDING_TOKEN
from serving.common.cpu_share import enforces_replica_share
from serving.common.logging import get_logger

logger = get_logger("disagg.deployments.shards")

#: Bind addresses meaning every interface: a replica bound there announces its node's IP, which others can dial.
_WILDCARDS = ("0.0.0.0", "::")
#: How long a replica shutting down waits to withdraw its address: when the whole app is deleted the directory may
#: be gone first, and a call to it would wait until Serve force-kills the replica (20 s by default).
WITHDRAW_TIMEOUT_S = 2.0


@serve.deployment(ray_actor_options={"num_cpus": 0})
class ShardDirectory:
    """Live addresses of every shard's replicas, as announced by the replicas themselves."""

    def __init__(self) -> None:
        self._expiry: dict[int, dict[str, float]] = {}

    def announce(self, shard_index: int, address: str, ttl_s: float) -> None:
        """Replica ``address`` of shard ``shard_index`` is serving; forget it unless re-announced within ``ttl_s``."""
        self._expiry.setdefault(shard_index, {})[address] = time.monotonic() + ttl_s

    def withdraw(self, shard_index: int, address: str) -> None:
        """The replica at ``address`` is shutting down."""
        self._expiry.get(shard_index, {}).pop(address, None)

    def addresses(self) -> dict[int, list[str]]:
        """Shard index -> addresses announced and not expired, sorted."""
        now = time.monotonic()
        for replicas in self._expiry.values():
            for address in [address for address, expiry in replicas.items() if expiry <= now]:
                del replicas[address]
        return {index: sorted(replicas) for index, replicas in self._expiry.items()}


@serve.deployment(ray_actor_options={"num_cpus": 0.25, "runtime_env": REPLICA_RUNTIME_ENV})
class EmbeddingShardServer:
    """One replica of one shard: builds only its own table slices (``embedding.layout()``) and serves them over
    gRPC."""

    @checks_allocator
    @enforces_replica_share
    async def __init__(self, config: DLRMAppConfig | dict[str, Any], shard_index: int,
                       directory: DeploymentHandle) -> None:
        config = DLRMAppConfig.model_validate(config)
        embedding = config.embedding
        host = ray.util.get_node_ip_address() if embedding.bind_host == "node" else embedding.bind_host
        if problem := exposure_problem(host, secured=embedding.tls or bool(EMBEDDING_TOKEN)):
            raise ValueError(f"embedding.bind_host ({embedding.bind_host}): {problem}")
        tls = server_tls(embedding)
        shard = await asyncio.to_thread(build_embedding_shard, model_source(config.model), shard_index,
                                        embedding.layout())
        self._server = EmbeddingServer(
            shard, model=config.model.label, num_shards=embedding.num_shards, host=host, port=0,
            max_message_bytes=embedding.max_message_bytes, torch_threads=embedding.torch_threads,
            tls=tls, token=EMBEDDING_TOKEN,
        )
        port = await self._server.start()
        self._busy = BusyFraction(lambda: self._server.busy_seconds)
        self._address = host_port(ray.util.get_node_ip_address(), port) if host in _WILDCARDS else self._server.address
        self._shard_index = shard_index
        self._directory = directory
        self._ttl_s = 3 * embedding.discovery_period_s
        await self._announce()
        logger.info("embedding shard %d/%d of %s (seed %d, weights %s, version %s) serving %d table slices (%s "
                    "bytes) on %s (%s), node %s", shard_index, embedding.num_shards, config.model.label,
                    config.model.seed, config.model.weights_path(), shard.version[:12], len(shard.slices),
                    f"{shard.parameter_bytes:,}", self._server.address, self._server.security,
                    ray.get_runtime_context().get_node_id()[:8])

    async def _announce(self) -> None:
        await self._directory.announce.remote(self._shard_index, self._address, self._ttl_s)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (``BusyTimePolicy``): the share of time since the previous call with a
        lookup in flight."""
        return {BUSY_METRIC: self._busy.fraction()}

    async def traffic(self) -> tuple[int, int]:
        """Bytes of the lookups this replica answered: serialized requests received and replies sent."""
        return self._server.traffic

    async def address(self) -> str:
        """Where this replica serves gRPC (``host:port``, the node's IP when bound to every interface)."""
        return self._address

    async def node_id(self) -> str:
        """The Ray node this replica runs on."""
        return ray.get_runtime_context().get_node_id()

    async def check_health(self) -> None:
        """Serve's periodic health check doubles as the directory heartbeat."""
        await self._announce()

    async def __del__(self) -> None:  # Serve awaits an async __del__ on graceful replica shutdown
        try:
            await asyncio.wait_for(self._directory.withdraw.remote(self._shard_index, self._address),
                                   WITHDRAW_TIMEOUT_S)
        except Exception as error:  # the address expires from a live directory within ttl_s anyway
            logger.info("embedding shard %d at %s: not withdrawn from the directory (%s: %s)", self._shard_index,
                        self._address, type(error).__name__, error)
        await self._server.stop(grace=1.0)
