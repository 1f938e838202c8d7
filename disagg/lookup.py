"""The embedding part of a model computed on the dense side from rows held elsewhere.

Per batch: each table's ids are deduplicated (``EmbeddingLookups.unique_ids``); ids whose rows the hot-embedding
cache holds skip the RPC; the others go, as local int32 ids, only to the shards holding their table slices (one
call per shard, split into concurrent chunks when a reply would pass half the gRPC message limit); the rows come
back in ``wire_dtype`` and the bags are pooled here through the inverse index. The shard clients refuse rows of a
table version other than the expected one (``ShardVersionMismatch``), so the cache only ever holds rows of the
model this replica serves; it is dropped for a shard's tables whenever the shard reports a new version.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from disagg.embedding_cache import EmbeddingCache
from disagg.id_space import IdGroup, IdSpace
from disagg.partition import EmbeddingLookups, UniqueIds
from disagg.rpc import wire
from disagg.rpc.client import EmbeddingClient
from disagg.rpc.packed import PackedReply
from disagg.tables import TableShard, TableSlice
from serving.common.metrics import NO_METRICS, Metrics


class ShardCall(NamedTuple):
    """One packed lookup: shard ``shard`` asked for ``counts[i]`` ids of its slice ``i`` (``ids``: 1-D local int32
    ids, slice after slice, in the order the shard holds its slices)."""

    shard: int
    ids: torch.Tensor
    counts: list[int]


class RowSource(Protocol):
    """Where rows come from: ``disagg.rpc.client.EmbeddingClient`` (the shards over gRPC) or ``LocalRows``."""

    def start_packed(
        self, calls: Sequence[ShardCall], *, timeout_s: float, output_dtype: str = ""
    ) -> Awaitable[list[PackedReply]]:
        """Starts ``calls`` now; the awaitable gives, per call in order, its rows: each slice's ``[count, width]``
        rows flattened, slice after slice."""
        ...


class LocalRows:
    """The shards' tables in this process: what ``EmbeddingClient`` returns, without gRPC (evaluation, tests)."""

    def __init__(self, shards: Sequence[TableShard]) -> None:
        self._shards = tuple(shards)

    def start_packed(
        self, calls: Sequence[ShardCall], *, timeout_s: float, output_dtype: str = ""
    ) -> Awaitable[list[PackedReply]]:
        return self._lookup(list(calls), output_dtype)

    async def _lookup(self, calls: list[ShardCall], output_dtype: str) -> list[PackedReply]:
        dtype = wire.ROW_DTYPES[output_dtype]
        replies = []
        for call in calls:
            module = self._shards[call.shard].module
            rows = module.gather(list(call.ids.split(call.counts)), dtype)
            replies.append(PackedReply(rows, list(module.widths), self._shards[call.shard].version))
        return replies


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
class PreparedBatch:
    """One batch between ``RemoteEmbeddings.prepare`` and ``finish``: unique ids, their rows so far, what is still
    missing and the calls that fetch it."""

    unique: UniqueIds
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # width -> [its unique ids, dim], cached rows in
    missing: dict[int, _Missing] = field(default_factory=dict)  # width -> what the cache lacked (with a cache)
    #: the packed lookups to make (shards with no missing id are not called; big replies split into chunks)
    calls: list[ShardCall] = field(default_factory=list)
    #: per shard, how many ids each of its slices asks for
    counts: list[list[int]] = field(default_factory=list)
    hits: int = 0
    misses: int = 0


class RemoteEmbeddings:
    """``await embeddings(inputs, timeout_s=...)`` returns what ``partition.embedding_part(**inputs)`` would.

    It runs where it is called, with no thread hop: ``prepare`` (dedup, cache, the packed calls), ``send`` (the
    calls, concurrently, started before it returns), ``finish`` (rows into place, cache, pooling); a caller may
    run other work while the calls are in flight, as the dense replica runs its bottom MLP. ``plan[i]`` lists the
    slices shard ``i`` of ``source`` holds (``TableLayout.plan``). ``cache`` (None: no cache) holds float32 rows
    by table.
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
        self._row_element = wire.ROW_DTYPES[wire_dtype].itemsize
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
        where = {piece.name: (at, position) for at, part in enumerate(self._parts)
                 for position, piece in enumerate(part.slices)}
        #: per shard, where each of its slices sits: (part, position among the part's slices)
        self._places = [[where[piece.name] for piece in slices] for slices in self._plan]
        self._widths = [[piece.dim for piece in slices] for slices in self._plan]

    async def __call__(self, inputs: Mapping[str, torch.Tensor], *, timeout_s: float) -> dict[str, torch.Tensor]:
        batch = self.prepare(inputs)
        return self.finish(inputs, batch, await self.send(batch, timeout_s=timeout_s))

    def drop_cached_on_new_versions(self, client: EmbeddingClient) -> None:
        """Drop a shard's tables from the cache whenever ``client`` sees that shard answer with a new version."""
        for shard in client.shards:
            shard.on_new_version = lambda index, _version: self.drop_cached(index)

    def drop_cached(self, shard_index: int) -> None:
        """Forget the cached rows of every table shard ``shard_index`` holds a slice of."""
        if self.cache is not None:
            for table in self._shard_tables[shard_index]:
                self.cache.clear(table)

    def prepare(self, inputs: Mapping[str, torch.Tensor]) -> PreparedBatch:
        """Deduplicate, take what the cache holds, and pack the missing ids into one call per shard (chunks when a
        reply would pass half the message limit); ValueError naming the table of an id outside its rows."""
        batch = PreparedBatch(self.lookups.unique_ids(inputs))
        local: list[list[torch.Tensor]] = []  # per part, each slice's local int32 ids
        for part in self._parts:
            unique = batch.unique.groups[part.group.dim]
            missing = unique.ids  # space ids, sorted: by slice, then id
            if self.cache is not None:
                table_ids = unique.ids - torch.repeat_interleave(part.bases, torch.tensor(unique.counts))
                hit, cached = self.cache.lookup(part.group.tables, unique.counts, table_ids)
                rows = torch.empty(unique.ids.shape[0], part.group.dim)
                rows[hit] = cached
                positions = torch.nonzero(~hit).squeeze(1)
                missing = unique.ids.index_select(0, positions)
                batch.rows[part.group.dim] = rows
                batch.missing[part.group.dim] = _Missing(
                    positions, table_ids.index_select(0, positions),
                    torch.searchsorted(missing, part.table_bounds).diff().tolist())
                batch.hits += unique.ids.shape[0] - missing.shape[0]
            batch.misses += missing.shape[0]
            per_slice = torch.searchsorted(missing, part.stops).diff(prepend=torch.zeros(1, dtype=torch.int64))
            local_ids = (missing - torch.repeat_interleave(part.starts, per_slice)).to(torch.int32)
            local.append(list(local_ids.split(per_slice.tolist())))
        for shard, places in enumerate(self._places):
            ids = [local[at][position] for at, position in places]
            counts = [part.shape[0] for part in ids]
            batch.counts.append(counts)
            if any(counts):
                batch.calls += self._chunks(shard, torch.cat(ids), counts)
        return batch

    def _chunks(self, shard: int, ids: torch.Tensor, counts: list[int]) -> list[ShardCall]:
        """The calls asking ``shard`` for ``ids``: one, or contiguous runs of the packed ids whose replies each stay
        under half the message limit (their replies, concatenated in order, are the one call's)."""
        reply_bytes = sum(count * width for count, width in zip(counts, self._widths[shard], strict=True))
        chunks = min(ids.shape[0], math.ceil(reply_bytes * self._row_element / self._max_reply_bytes))
        if chunks <= 1:
            return [ShardCall(shard, ids, counts)]
        bounds = [round(chunk * ids.shape[0] / chunks) for chunk in range(chunks + 1)]
        starts = [0, *itertools.accumulate(counts)]
        return [ShardCall(shard, ids[low:high], [max(0, min(high, stop) - max(low, start))
                                                 for start, stop in itertools.pairwise(starts)])
                for low, high in itertools.pairwise(bounds)]

    def send(self, batch: PreparedBatch, *, timeout_s: float) -> Awaitable[list[torch.Tensor | None]]:
        """Starts the batch's calls now; the awaitable gives every shard's rows (the calls' replies joined per
        shard, None for a shard not called) in the wire dtype; the first failing call's error propagates."""
        if not batch.calls:  # the cache held every row
            return _done([None] * len(self._plan))
        replies = self.source.start_packed(batch.calls, timeout_s=timeout_s, output_dtype=self._wire_dtype)
        return self._joined(batch, replies)

    async def _joined(self, batch: PreparedBatch, pending: Awaitable[list[PackedReply]]) -> list[torch.Tensor | None]:
        replies = await pending
        per_shard: list[list[torch.Tensor]] = [[] for _ in self._plan]
        for call, reply in zip(batch.calls, replies, strict=True):
            if reply.widths != self._widths[call.shard] and call.ids.shape[0]:
                raise ValueError(f"shard {call.shard} sent rows of widths {reply.widths}, the plan's slices are "
                                 f"{self._widths[call.shard]} wide")
            per_shard[call.shard].append(reply.rows)
        return [None if not rows else rows[0] if len(rows) == 1 else torch.cat(rows) for rows in per_shard]

    def finish(self, inputs: Mapping[str, torch.Tensor], batch: PreparedBatch,
               fetched: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Fill the fetched rows in, cache them, pool."""
        got: list[list[torch.Tensor | None]] = [[None] * len(part.slices) for part in self._parts]
        for shard, rows in enumerate(fetched):
            if rows is None:
                continue
            counts, widths = batch.counts[shard], self._widths[shard]
            sizes = [count * width for count, width in zip(counts, widths, strict=True)]
            for (at, position), piece, count, width in zip(self._places[shard], rows.split(sizes), counts, widths,
                                                           strict=True):
                got[at][position] = piece.view(count, width)
        rows: dict[int, torch.Tensor] = {}
        for part, pieces in zip(self._parts, got, strict=True):
            dim = part.group.dim
            present = [piece for piece in pieces if piece is not None]
            fresh = torch.cat(present).to(torch.float32) if present else torch.empty(0, dim)
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


async def _done(value: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return value
