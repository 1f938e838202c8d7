"""Ray Serve application builder: ``import_path: disagg.app:build_app`` with ``args`` = ``DLRMAppConfig``.

No ``from __future__ import annotations`` here: Ray (and ``autoconfig.serve_config``) validate
``args`` into the builder's parameter annotation only when it is a real pydantic class, not a string.
"""

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from disagg.config import DLRMAppConfig
from disagg.deployments.disaggregated import DisaggregatedDLRM
from disagg.deployments.monolithic import MonolithicDLRM
from disagg.deployments.shards import EmbeddingShardServer, ShardDirectory
from disagg.model_check import check_model
from serving.common.backpressure import OVERLOADED
from serving.common.logging import get_logger

logger = get_logger("disagg.deployments.app")


def ingress_options(config: DLRMAppConfig) -> dict[str, Any]:
    """Serve options of the ingress deployment (a Serve config's ``deployments`` entry overrides them).

    Room for one full batch running and the next one filling (fewer would cap the batch size), and one batch more
    waiting in Serve's proxy; beyond that the proxy answers 503 with ``Retry-After`` at once. A deeper queue only
    adds to every admitted request's latency; a shallower one refuses requests at capacity, since a finished
    batch's callers send their next requests before the router sees the slots free. The router retries a request
    waiting for the full replica at most every 50 ms: nothing wakes it when a batch finishes, and Serve's default
    backoff ceiling left the replica idle between batches under overload (docs/RELIABILITY.md, "Overload").
    """
    return {
        "max_ongoing_requests": 2 * config.batching.max_batch_size,
        "max_queued_requests": config.batching.max_batch_size,
        "backpressure_config": OVERLOADED,
        "request_router_config": RequestRouterConfig(initial_backoff_s=0.005, max_backoff_s=0.05),
    }


def build_app(args: DLRMAppConfig) -> Application:
    """The DLRM app (served under the route prefix ``/v2``); a plain dict of args works too.

    ``disaggregated``: ``DisaggregatedDLRM`` (ingress, dense part) + ``EmbeddingShard_<i>`` deployments (gRPC
    servers, ``embedding.replicas_per_shard`` replicas each) + ``ShardDirectory``. ``monolithic``: ``MonolithicDLRM``.
    The model is checked first (``check_model``: factory, weights, signature, graph), so a model no replica could
    serve fails here with a ``ModelError`` naming the key, before any replica starts.
    """
    config = DLRMAppConfig.model_validate(args)
    report = check_model(config)
    for note in report.notes:
        logger.warning("%s: %s", config.model_name, note)
    options = ingress_options(config)
    if config.serving == "monolithic":
        return MonolithicDLRM.options(**options).bind(config)
    embedding = config.embedding
    directory = ShardDirectory.bind()
    shards = [
        EmbeddingShardServer.options(
            name=f"EmbeddingShard_{index}", num_replicas=embedding.replicas_per_shard,
            health_check_period_s=embedding.discovery_period_s,
        ).bind(config, index, directory)
        for index in range(embedding.num_shards)
    ]
    return DisaggregatedDLRM.options(**options).bind(config, directory, shards)
