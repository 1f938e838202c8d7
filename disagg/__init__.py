"""Disaggregated DLRM serving: model, partitioner, embedding shards, OIP v2 API, deployments.

Names are imported on first use, so ``import disagg`` loads neither torch nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.common.lazy import lazy_exports

if TYPE_CHECKING:
    from disagg.app import build_app
    from disagg.config import BatchingConfig, DLRMAppConfig, DLRMLimits, DLRMModelConfig, EmbeddingServiceConfig
    from disagg.model import DLRM, build_preset, materialize_
    from disagg.partition import (
        EmbeddingShard,
        Partition,
        build_dense_part,
        build_embedding_shard,
        partition_embeddings,
    )
    from disagg.rpc.client import EmbeddingClient, EmbeddingRequestError, ShardClient, ShardUnavailable
    from disagg.rpc.server import EmbeddingServer
    from disagg.spec import PRESETS, DLRMSpec, preset_spec
    from disagg.synthetic import SyntheticRequests

_EXPORTS = {
    "BatchingConfig": "disagg.config",
    "DLRMAppConfig": "disagg.config",
    "DLRMLimits": "disagg.config",
    "DLRMModelConfig": "disagg.config",
    "EmbeddingServiceConfig": "disagg.config",
    "DLRMSpec": "disagg.spec",
    "PRESETS": "disagg.spec",
    "preset_spec": "disagg.spec",
    "DLRM": "disagg.model",
    "build_preset": "disagg.model",
    "materialize_": "disagg.model",
    "EmbeddingShard": "disagg.partition",
    "Partition": "disagg.partition",
    "build_dense_part": "disagg.partition",
    "build_embedding_shard": "disagg.partition",
    "partition_embeddings": "disagg.partition",
    "SyntheticRequests": "disagg.synthetic",
    "EmbeddingServer": "disagg.rpc.server",
    "EmbeddingClient": "disagg.rpc.client",
    "EmbeddingRequestError": "disagg.rpc.client",
    "ShardClient": "disagg.rpc.client",
    "ShardUnavailable": "disagg.rpc.client",
    "build_app": "disagg.app",
}

__all__ = [
    "DLRM",
    "PRESETS",
    "BatchingConfig",
    "DLRMAppConfig",
    "DLRMLimits",
    "DLRMModelConfig",
    "DLRMSpec",
    "EmbeddingClient",
    "EmbeddingRequestError",
    "EmbeddingServer",
    "EmbeddingServiceConfig",
    "EmbeddingShard",
    "Partition",
    "ShardClient",
    "ShardUnavailable",
    "SyntheticRequests",
    "build_app",
    "build_dense_part",
    "build_embedding_shard",
    "build_preset",
    "materialize_",
    "partition_embeddings",
    "preset_spec",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)
