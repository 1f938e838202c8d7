"""The embedding part of a model computed on the dense side from rows held elsewhere.

Per batch: each table's ids are deduplicated (``EmbeddingLookups.unique_ids``); ids whose rows the hot-embedding
cache holds skip the RPC; the others go, as local int32 ids, only to the shards holding their table slices (one
call per shard, split into concurrent chunks when a reply would pass half the gRPC message limit); the rows come
back in ``wire_dtype`` and the bags are pooled here through the inverse index. The shard clients refuse rows of a
table version other than the expected one (``ShardVersionMismatch``), so the cache only ever holds rows of the
model this replica serves; it is dropped for a shard's tables whenever the shard reports a new version.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from disagg.embedding_cache import EmbeddingCache
from disagg.id_space import IdGroup, IdSpace
from disagg.partition import EmbeddingLookups, UniqueIds
from disagg.rpc import wire
from disagg.rpc.client import EmbeddingClient
from disagg.tables import TableShard, TableSlice
from serving.common.metrics import NO_METRICS, Metrics


class RowSource(Protocol):
    """Where rows come from: ``disagg.rpc.client.EmbeddingClient`` (the shards over gRPC) or ``LocalRows``."""

    async def lookup(
        self, inputs: Mapping[str, torch.Tensor], *, timeout_s: float, output_dtype: str = ""
    ) -> dict[str, torch.Tensor]:
        """Rows for each slice's local ids (``inputs`` by slice name); slices with no ids may be left out."""
        ...


class LocalRows:
    """The shards' tables in this process: what ``EmbeddingClient`` returns, without gRPC (evaluation, tests)."""

    def __init__(self, shards: Sequence[TableShard]) -> None:
        self._shards = tuple(shards)

    async def lookup(
        self, inputs: Mapping[str, torch.Tensor], *, timeout_s: float, output_dtype: str = ""
    ) -> dict[str, torch.Tensor]:
        dtype = wire.ROW_DTYPES[output_dtype]
        found: dict[str, torch.Tensor] = {}
        for shard in self._shards:
            mine = {name: inputs[name] for name in shard.input_names}
            if any(ids.numel() for ids in mine.values()):
                found |= {name: rows.to(dtype) for name, rows in shard.module(**mine).items()}
        return found


@dataclass(frozen=True)
class _Slices:
    """The slices of one row width's tables in id-space order, each slice's bounds in the space, and the first id
    of each table (``IdSpace``)."""

    group: IdGroup
    slices: tuple[TableSlice, ...]
    starts: torch.Tensor  # int64 [slices]
    stops: torch.Tensor
    bases: torch.Tensor  # int64 [tables of the group]
    table_bounds: torch.Tensor  # int64 [tables + 1]

    @classmethod
    def of(cls, space: IdSpace, group: IdGroup, pieces: Mapping[str, Sequence[TableSlice]]) -> _Slices:
        ordered = [piece for table in group.tables for piece in sorted(pieces[table], key=lambda p: p.row_start)]
        return cls(group, tuple(ordered),
                   torch.tensor([space.base[piece.table] + piece.row_start for piece in ordered], dtype=torch.int64),
                   torch.tensor([space.base[piece.table] + piece.row_stop for piece in ordered], dtype=torch.int64),
                   space.bases(group.tables), space.bounds(group.tables))


@dataclass
class _Missing:
    """One width's ids the cache did not hold: their positions among the width's unique ids, their table-local ids
    and how many per table (for the cache insert)."""

    positions: torch.Tensor
    ids: torch.Tensor
    counts: list[int]


@dataclass
class _Batch:
    """One batch between its preparation and its pooling: unique ids, their rows so far, what is still missing."""

    unique: UniqueIds
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # width -> [its unique ids, dim], cached rows in
    missing: dict[int, _Missing] = field(default_factory=dict)  # width -> what the cache lacked (with a cache)
    #: slice name -> local int32 ids to fetch (every slice of the plan, empty when nothing is missing)
    requests: dict[str, torch.Tensor] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0


class RemoteEmbeddings:
    """``await embeddings(inputs, timeout_s=...)`` returns what ``partition.embedding_part(**inputs)`` would.

    ``plan[i]`` lists the slices shard ``i`` of ``source`` holds (``TableLayout.plan``); ``source`` takes their
    names as inputs. ``cache`` (None: no cache) holds float32 rows by table.
    """

    def __init__(
        self,
        lookups: EmbeddingLookups,
        plan: Sequence[Sequence[TableSlice]],
        source: RowSource,
        *,
        cache: EmbeddingCache | None = None,
        wire_dtype: str = "float32",
        max_message_bytes: int = 64 * 1024 * 1024,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        if wire_dtype not in wire.ROW_DTYPE_NAMES:
            raise ValueError(f"wire_dtype must be one of {', '.join(wire.ROW_DTYPE_NAMES)}, got {wire_dtype!r}")
        self.lookups = lookups
        self.cache = cache
        self.source = source
        self._plan = [tuple(slices) for slices in plan]
        self._wire_dtype = wire_dtype
        self._max_reply_bytes = max_message_bytes // 2
        self._metrics = metrics
        pieces: dict[str, list[TableSlice]] = {table: [] for table in lookups.tables}
        self._shard_tables: list[set[str]] = []
        for slices in plan:
            for piece in slices:
                if piece.table not in pieces:
                    raise ValueError(f"the plan holds table {piece.table!r}, which the model does not look up")
                pieces[piece.table].append(piece)
            self._shard_tables.append({piece.table for piece in slices})
        for table, held in pieces.items():
            covered = sorted((piece.row_start, piece.row_stop) for piece in held)
            edges = [0, *(bound for pair in covered for bound in pair), lookups.tables[table][0]]
            if not covered or edges[0::2] != edges[1::2]:
                raise ValueError(f"the plan's slices of table {table!r} do not cover its rows exactly once: {covered}")
        self._parts = [_Slices.of(lookups.space, group, pieces) for group in lookups.space.groups]

    async def __call__(self, inputs: Mapping[str, torch.Tensor], *, timeout_s: float) -> dict[str, torch.Tensor]:
        batch = await asyncio.to_thread(self._prepare, inputs)
        fetched = await self._fetch(batch.requests, timeout_s)
        return await asyncio.to_thread(self._finish, inputs, batch, fetched)

    def drop_cached_on_new_versions(self, client: EmbeddingClient) -> None:
        """Drop a shard's tables from the cache whenever ``client`` sees that shard answer with a new version."""
        for shard in client.shards:
            shard.on_new_version = lambda index, _version: self.drop_cached(index)

    def drop_cached(self, shard_index: int) -> None:
        """Forget the cached rows of every table shard ``shard_index`` holds a slice of."""
        if self.cache is not None:
            for table in self._shard_tables[shard_index]:
                self.cache.clear(table)

    def _prepare(self, inputs: Mapping[str, torch.Tensor]) -> _Batch:
        """Deduplicate, take what the cache holds, and sort the missing ids into their slices."""
        batch = _Batch(self.lookups.unique_ids(inputs))
        for part in self._parts:
            unique = batch.unique.groups[part.group.dim]
            missing = unique.ids  # space ids, sorted: by slice, then id
            if self.cache is not None:
                local = unique.ids - torch.repeat_interleave(part.bases, torch.tensor(unique.counts))
                hit, cached = self.cache.lookup(part.group.tables, unique.counts, local)
                rows = torch.empty(unique.ids.shape[0], part.group.dim)
                rows[hit] = cached
                positions = torch.nonzero(~hit).squeeze(1)
                missing = unique.ids.index_select(0, positions)
                batch.rows[part.group.dim] = rows
                batch.missing[part.group.dim] = _Missing(
                    positions, local.index_select(0, positions),
                    torch.searchsorted(missing, part.table_bounds).diff().tolist())
                batch.hits += unique.ids.shape[0] - missing.shape[0]
            batch.misses += missing.shape[0]
            per_slice = torch.searchsorted(missing, part.stops).diff(prepend=torch.zeros(1, dtype=torch.int64))
            local_ids = (missing - torch.repeat_interleave(part.starts, per_slice)).to(torch.int32)
            batch.requests |= dict(zip((piece.name for piece in part.slices), local_ids.split(per_slice.tolist()),
                                       strict=True))
        return batch

    async def _fetch(self, requests: dict[str, torch.Tensor], timeout_s: float) -> dict[str, torch.Tensor]:
        """Rows for every requested id, in request order; concurrent chunks keep each reply under the limit."""
        if not any(ids.numel() for ids in requests.values()):  # the cache held every row
            return {}
        row_element = wire.ROW_DTYPES[self._wire_dtype].itemsize
        reply_bytes = max(
            sum(requests[piece.name].shape[0] * piece.dim * row_element for piece in slices) for slices in self._plan
        )
        chunks = max(1, math.ceil(reply_bytes / self._max_reply_bytes))
        if chunks == 1:
            return await self.source.lookup(requests, timeout_s=timeout_s, output_dtype=self._wire_dtype)
        parts = {name: torch.tensor_split(ids, chunks) for name, ids in requests.items()}
        replies = await asyncio.gather(*(
            self.source.lookup({name: split[chunk] for name, split in parts.items()}, timeout_s=timeout_s,
                                output_dtype=self._wire_dtype)
            for chunk in range(chunks)
        ))
        return {name: torch.cat([reply[name] for reply in replies if name in reply])
                for name in requests if any(name in reply for reply in replies)}

    def _finish(
        self, inputs: Mapping[str, torch.Tensor], batch: _Batch, fetched: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Fill the fetched rows in, cache them, pool."""
        rows: dict[int, torch.Tensor] = {}
        for part in self._parts:
            dim = part.group.dim
            got = [fetched[piece.name] for piece in part.slices if piece.name in fetched]
            fresh = torch.cat(got).to(torch.float32) if got else torch.empty(0, dim)
            missing = batch.missing.get(dim)
            if missing is None:  # no cache: the fetched rows are every unique id's, in order
                rows[dim] = fresh
                continue
            rows[dim] = batch.rows[dim]
            if missing.positions.shape[0]:
                rows[dim][missing.positions] = fresh
                self.cache.insert(part.group.tables, missing.counts, missing.ids, fresh)
        if self.cache is not None:
            self._metrics.embedding_cache(batch.hits, batch.misses)
        return self.lookups(inputs, batch.unique, rows)
