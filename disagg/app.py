"""Ray Serve application builder: ``import_path: disagg.app:build_app`` with ``args`` = ``DLRMAppConfig``.

No ``from __future__ import annotations`` here: Ray (and ``serving.common.serve_config``) validate
``args`` into the builder's parameter annotation only when it is a real pydantic class, not a string.
"""

from ray.serve import Application
from ray.serve.config import BackpressureConfig

from disagg.config import DLRMAppConfig
from disagg.disaggregated import DisaggregatedDLRM
from disagg.monolithic import MonolithicDLRM
from disagg.shard_service import EmbeddingShardServer, ShardDirectory


def build_app(args: DLRMAppConfig) -> Application:
    """The DLRM app (served under the route prefix ``/v2``); a plain dict of args works too.

    ``disaggregated``: ``DisaggregatedDLRM`` (ingress, dense part) + ``EmbeddingShard_<i>`` deployments (gRPC
    servers, ``embedding.replicas_per_shard`` replicas each) + ``ShardDirectory``. ``monolithic``: ``MonolithicDLRM``.
    """
    config = DLRMAppConfig.model_validate(args)
    # Room for one full batch running and the next one filling; fewer would cap the batch size. Two more batches
    # may wait in Serve's proxy; beyond that the proxy answers 503 with Retry-After at once (overload).
    ingress_options = {
        "max_ongoing_requests": 2 * config.batching.max_batch_size,
        "max_queued_requests": 2 * config.batching.max_batch_size,
        "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=1),
    }
    if config.serving == "monolithic":
        return MonolithicDLRM.options(**ingress_options).bind(config)
    embedding = config.embedding
    directory = ShardDirectory.bind()
    shards = [
        EmbeddingShardServer.options(
            name=f"EmbeddingShard_{index}", num_replicas=embedding.replicas_per_shard,
            health_check_period_s=embedding.discovery_period_s,
        ).bind(config, index, directory)
        for index in range(embedding.num_shards)
    ]
    return DisaggregatedDLRM.options(**ingress_options).bind(config, directory, shards)
