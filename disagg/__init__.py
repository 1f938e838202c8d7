"""Disaggregated recommendation serving (DLRM presets or your own model): model sources and checks, partitioner,
embedding shards, OIP v2 API, deployments.

Names are imported on first use, so ``import disagg`` loads neither torch nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.common.lazy import lazy_exports

if TYPE_CHECKING:
    from disagg.app import build_app
    from disagg.config import (
        BatchingConfig,
        DLRMAppConfig,
        DLRMLimits,
        DLRMModelConfig,
        EmbeddingCacheConfig,
        EmbeddingServiceConfig,
    )
    from disagg.embedding_cache import EmbeddingCache
    from disagg.lookup import LocalRows, RemoteEmbeddings
    from disagg.model import DLRM, build_preset, materialize_
    from disagg.model_check import ModelReport, check_model
    from disagg.model_source import FactorySource, ModelError, ModelSource, PresetSource, model_source
    from disagg.partition import EmbeddingLookups, Partition, build_dense_part, embedding_lookups, partition_embeddings
    from disagg.rpc.client import (
        EmbeddingClient,
        EmbeddingRequestError,
        ShardClient,
        ShardUnavailable,
        ShardVersionMismatch,
    )
    from disagg.rpc.server import EmbeddingServer
    from disagg.signature import InputSignature, ModelSignature, OutputSignature
    from disagg.spec import PRESETS, DLRMSpec, preset_spec
    from disagg.synthetic import SignatureRequests, SyntheticRequests
    from disagg.tables import TableLayout, TableShard, TableSlice, build_embedding_shard

_EXPORTS = {
    "BatchingConfig": "disagg.config",
    "DLRMAppConfig": "disagg.config",
    "DLRMLimits": "disagg.config",
    "DLRMModelConfig": "disagg.config",
    "EmbeddingServiceConfig": "disagg.config",
    "EmbeddingCacheConfig": "disagg.config",
    "EmbeddingCache": "disagg.embedding_cache",
    "LocalRows": "disagg.lookup",
    "RemoteEmbeddings": "disagg.lookup",
    "TableLayout": "disagg.tables",
    "TableShard": "disagg.tables",
    "TableSlice": "disagg.tables",
    "EmbeddingLookups": "disagg.partition",
    "embedding_lookups": "disagg.partition",
    "ShardVersionMismatch": "disagg.rpc.client",
    "DLRMSpec": "disagg.spec",
    "PRESETS": "disagg.spec",
    "preset_spec": "disagg.spec",
    "DLRM": "disagg.model",
    "build_preset": "disagg.model",
    "materialize_": "disagg.model",
    "ModelReport": "disagg.model_check",
    "check_model": "disagg.model_check",
    "FactorySource": "disagg.model_source",
    "ModelError": "disagg.model_source",
    "ModelSource": "disagg.model_source",
    "PresetSource": "disagg.model_source",
    "model_source": "disagg.model_source",
    "InputSignature": "disagg.signature",
    "ModelSignature": "disagg.signature",
    "OutputSignature": "disagg.signature",
    "Partition": "disagg.partition",
    "build_dense_part": "disagg.partition",
    "build_embedding_shard": "disagg.tables",
    "partition_embeddings": "disagg.partition",
    "SignatureRequests": "disagg.synthetic",
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
    "EmbeddingCache",
    "EmbeddingCacheConfig",
    "EmbeddingClient",
    "EmbeddingLookups",
    "EmbeddingRequestError",
    "EmbeddingServer",
    "EmbeddingServiceConfig",
    "FactorySource",
    "InputSignature",
    "LocalRows",
    "ModelError",
    "ModelReport",
    "ModelSignature",
    "ModelSource",
    "OutputSignature",
    "Partition",
    "PresetSource",
    "RemoteEmbeddings",
    "ShardClient",
    "ShardUnavailable",
    "ShardVersionMismatch",
    "SignatureRequests",
    "SyntheticRequests",
    "TableLayout",
    "TableShard",
    "TableSlice",
    "build_app",
    "build_dense_part",
    "build_embedding_shard",
    "build_preset",
    "check_model",
    "embedding_lookups",
    "materialize_",
    "model_source",
    "partition_embeddings",
    "preset_spec",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)
