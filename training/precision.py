"""What reduced precision costs the trained tiny DLRM: held-out AUC with tables stored float16 or int8 row-wise and
rows sent float16 or bfloat16, against float32, computed by the same code the shards and dense replicas run
(``TableShard``, ``RemoteEmbeddings``), in this process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from disagg.config import StorageDtype, WireDtype
from disagg.lookup import LocalRows, RemoteEmbeddings
from disagg.model_source import PresetSource
from disagg.partition import build_dense_part, embedding_lookups
from disagg.spec import preset_spec, preset_weights
from disagg.tables import TableLayout, build_embedding_shard
from training.click_logs import ClickLogs, roc_auc
from training.tiny_dlrm import shipped_report

#: A click-log stream neither the training (0) nor the validation (1) data of the shipped weights came from.
EVALUATION_STREAM = 12
#: The precision settings compared with float32 tables and wire.
SETTINGS: tuple[tuple[StorageDtype, WireDtype], ...] = (
    ("float32", "float32"), ("float16", "float32"), ("int8", "float32"), ("float32", "float16"),
    ("float32", "bfloat16"), ("int8", "float16"),
)


def served_model(*, storage: StorageDtype, wire: WireDtype, preset: str = "tiny", num_shards: int = 2
                 ) -> Callable[[torch.Tensor, torch.Tensor], Awaitable[torch.Tensor]]:
    """``await model(dense, sparse)``: click probabilities [rows, 1] of ``preset``'s shipped weights served
    disaggregated, with ``storage`` tables in ``num_shards`` in-process shards and ``wire`` rows."""
    source = PresetSource(preset, 0, preset_weights(preset))
    layout = TableLayout(num_shards, storage_dtype=storage)
    partition = build_dense_part(source)
    lookups = embedding_lookups(partition)
    shards = [build_embedding_shard(source, index, layout) for index in range(num_shards)]
    embeddings = RemoteEmbeddings(lookups, layout.plan(lookups.tables), LocalRows(shards), wire_dtype=wire)

    async def model(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        inputs = {"dense": dense, "sparse": sparse}
        cut = await embeddings({name: inputs[name] for name in partition.embedding_inputs}, timeout_s=60.0)
        with torch.inference_mode():
            return partition.dense_part(**{name: inputs[name] for name in partition.dense_inputs}, **cut)

    return model


def served_predictions(dense: torch.Tensor, sparse: torch.Tensor, *, storage: StorageDtype, wire: WireDtype,
                       preset: str = "tiny", num_shards: int = 2) -> torch.Tensor:
    """``served_model``'s click probabilities [rows] for one batch."""
    model = served_model(storage=storage, wire=wire, preset=preset, num_shards=num_shards)
    return asyncio.run(model(dense, sparse)).reshape(-1)


def precision_auc(rows: int = 65536, preset: str = "tiny") -> dict[str, Any]:
    """AUC on ``rows`` held-out click-log rows per setting of ``SETTINGS``, with its change against float32, and
    ``auc_change_int8`` (int8 tables, float32 wire)."""
    settings = shipped_report(preset)["settings"]
    logs = ClickLogs(preset_spec(preset), seed=settings["data_seed"], stream=EVALUATION_STREAM,
                     target_ctr=settings["target_ctr"])
    batch = logs.batch(rows)
    reference = served_predictions(batch.dense, batch.sparse, storage="float32", wire="float32", preset=preset)
    base_auc = roc_auc(reference, batch.labels)
    results = []
    for storage, wire in SETTINGS:
        predictions = served_predictions(batch.dense, batch.sparse, storage=storage, wire=wire, preset=preset)
        auc = roc_auc(predictions, batch.labels)
        results.append({"storage": storage, "wire": wire, "auc": auc, "auc_change": auc - base_auc,
                        "max_abs_prediction_change": float((predictions - reference).abs().max())})
    int8 = next(entry for entry in results if entry["storage"] == "int8" and entry["wire"] == "float32")
    return {"rows": results, "heldout_rows": rows, "auc_change_int8": int8["auc_change"]}
