"""Hot-embedding cache of the dense replicas: set-associative LRU / LFU caches of table rows.

A ``TableCache`` is ``sets x ways`` slots; an id may only live in the ways of its set (``set_index``), and every
operation on a batch of ids is a handful of vectorized torch ops (no per-id Python loop), as in the GPU embedding
caches of HugeCTR's HPS. ``EmbeddingCache`` splits one byte budget across the tables of a model, each table owning
its own sets of one ``TableCache`` per row width.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

import torch

from disagg.id_space import IdGroup, IdSpace

CachePolicy = Literal["lru", "lfu"]

_POLICIES: tuple[str, ...] = get_args(CachePolicy)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # Fibonacci hashing multiplier, as a signed int64
_METADATA_BYTES = 16  # per slot: int64 tag + int64 priority
_EMPTY = -1
_TAKEN = torch.iinfo(torch.int64).max


def set_index(ids: torch.Tensor, sets: int) -> torch.Tensor:
    """The set (``0 <= set < sets``) of each id: the high 32 bits of ``id * 0x9E3779B97F4A7C15`` (int64 wraparound)
    modulo ``sets``."""
    if sets < 1:
        raise ValueError(f"sets must be >= 1, got {sets}")
    hashed = ids.to(torch.int64) * _GOLDEN
    return ((hashed >> 32) & 0xFFFFFFFF) % sets


def _check_policy(policy: str) -> None:
    if policy not in _POLICIES:
        raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")


def _check_ways(ways: int) -> None:
    if ways < 1:
        raise ValueError(f"ways must be >= 1, got {ways}")


class TableCache:
    """A set-associative cache of one table's rows, keyed by (global) row id.

    ``sets = ceil(capacity_rows / ways)``, so ``capacity_rows`` is rounded up to whole sets; ``capacity_rows=0``
    disables the cache (every lookup misses, inserts do nothing). Priority per slot: LRU, the tick of its last use
    (the tick advances once per ``lookup`` call); LFU, its use count (1 when inserted). Empty slots have tag and
    priority -1, so they are always the first victims. Lookups, inserts and ``clear`` hold one lock, so batches
    may use the cache from several threads.
    """

    def __init__(
        self, dim: int, capacity_rows: int, *, policy: CachePolicy, ways: int = 8, dtype: torch.dtype = torch.float32
    ) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if capacity_rows < 0:
            raise ValueError(f"capacity_rows must be >= 0, got {capacity_rows}")
        _check_policy(policy)
        _check_ways(ways)
        self.dim = dim
        self.policy: CachePolicy = policy
        self.ways = ways
        self.sets = math.ceil(capacity_rows / ways)
        slots = self.sets * ways
        self.tags = torch.full((slots,), _EMPTY, dtype=torch.int64)
        self.rows = torch.zeros((slots, dim), dtype=dtype)
        self.priority = torch.full((slots,), _EMPTY, dtype=torch.int64)
        self.hits = 0
        self.lookups = 0
        self._tick = 0
        self._way = torch.arange(ways)
        self._lock = threading.Lock()

    @property
    def capacity_rows(self) -> int:
        """Number of slots (``sets * ways``)."""
        return self.sets * self.ways

    @property
    def nbytes(self) -> int:
        """Bytes of the storage: rows, tags and priorities."""
        return sum(t.element_size() * t.numel() for t in (self.rows, self.tags, self.priority))

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
        ids = ids.to(torch.int64)
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"ids must be >= 0, got {int(ids.min())}")
        return ids

    def _find(self, ids: torch.Tensor, sets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(set of each id, whether it is cached, its slot where cached)."""
        if sets is None:
            sets = set_index(ids, self.sets)
        first = sets * self.ways
        slots = (first.unsqueeze(1) + self._way).view(-1)
        match = self.tags.index_select(0, slots).view(-1, self.ways) == ids.unsqueeze(1)
        hit, way = match.max(dim=1)
        return sets, hit, (first + way).masked_select(hit)

    def lookup(self, ids: torch.Tensor, sets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit [n] bool, rows [n_hit, dim])`` for unique ids >= 0; the rows (a copy) are those of ``ids[hit]``,
        in that order. Hits count as a use (LRU tick / LFU count + 1). ``sets``: each id's set, when the caller
        places ids itself (``EmbeddingCache``); default ``set_index(ids, self.sets)``."""
        ids = self._ids(ids)
        with self._lock:
            self.lookups += ids.numel()
            if self.sets == 0:
                return torch.zeros(ids.shape, dtype=torch.bool), self.rows.new_empty((0, self.dim))
            self._tick += 1
            _, hit, slots = self._find(ids, sets)
            rows = self.rows.index_select(0, slots)
            if self.policy == "lru":
                self.priority.index_fill_(0, slots, self._tick)
            else:
                self.priority.index_add_(0, slots, torch.ones_like(slots))
            self.hits += slots.numel()
            return hit, rows

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, sets: torch.Tensor | None = None) -> None:
        """Cache ``rows[i]`` as the row of ``ids[i]`` (unique ids >= 0; duplicates are not checked).

        Ids already cached are left as they are (row and priority unchanged). New ids of one set, in batch order,
        take that set's ways lowest priority first (empty ways first, then lower way index on ties): the j-th new
        id takes the j-th victim, and new ids beyond ``ways`` in one set are not cached. No slot is written twice
        per call, so a slot's tag and row always come from the same id. New entries get LRU priority = the
        current tick, LFU count = 1. ``sets`` as for ``lookup``.
        """
        ids = self._ids(ids)
        if rows.shape != (ids.numel(), self.dim):
            raise ValueError(f"rows must have shape {(ids.numel(), self.dim)}, got {tuple(rows.shape)}")
        with self._lock:
            if self.sets == 0 or ids.numel() == 0:
                return
            sets, hit, _ = self._find(ids, sets)
            new = (~hit).nonzero().squeeze(1)
            if new.numel() == 0:
                return
            sets, order = torch.sort(sets.index_select(0, new), stable=True)
            new = new.index_select(0, order)
            # Rank of each new id among the new ids of its set (batch order within a set, by the stable sort).
            targets, group, counts = torch.unique_consecutive(sets, return_inverse=True, return_counts=True)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(new.numel()) - starts.index_select(0, group)
            rounds = int(counts.max())
            if rounds > self.ways:
                keep = rank < self.ways
                new, group, rank = new[keep], group[keep], rank[keep]
                rounds = self.ways
            # The j-th victim of a set is its j-th lowest-priority way (argmin: the lowest way on ties).
            keys = self.priority.view(self.sets, self.ways).index_select(0, targets)
            victims = torch.empty((targets.numel(), rounds), dtype=torch.int64)
            for j in range(rounds):
                way = keys.argmin(dim=1, keepdim=True)
                victims[:, j : j + 1] = way
                keys.scatter_(1, way, _TAKEN)
            victims += targets.unsqueeze(1) * self.ways
            slots = victims.view(-1).index_select(0, group * rounds + rank)
            self.tags.index_copy_(0, slots, ids.index_select(0, new))
            self.rows.index_copy_(0, slots, rows.index_select(0, new).to(self.rows.dtype))
            self.priority.index_fill_(0, slots, self._tick if self.policy == "lru" else 1)

    def clear(self, first_set: int = 0, stop_set: int | None = None) -> None:
        """Empty the slots of sets ``[first_set, stop_set)`` (default: all); the hit and lookup counters are kept."""
        start, stop = first_set * self.ways, (self.sets if stop_set is None else stop_set) * self.ways
        with self._lock:
            self.tags[start:stop] = _EMPTY
            self.priority[start:stop] = _EMPTY


class _Group:
    """The tables of one row width, sharing one ``TableCache``: table ``i`` owns sets ``[set_start[i], set_start[i] +
    sets[i])`` and its id ``x`` is tagged ``base[i] + x``, its id in the width's run of the ``IdSpace``."""

    def __init__(self, cache: TableCache, group: IdGroup, space: IdSpace, sets: list[int]) -> None:
        names = group.tables
        self.cache = cache
        self.index = {name: position for position, name in enumerate(names)}
        self.base = space.bases(names) - group.start
        self.sets = torch.tensor(sets)
        self.set_start = torch.tensor([0, *sets[:-1]]).cumsum(0)
        self.hits = torch.zeros(len(names), dtype=torch.int64)
        self.lookups = torch.zeros(len(names), dtype=torch.int64)
        self.lock = threading.Lock()  # of the counters; the TableCache has its own


class EmbeddingCache:
    """Cached rows of every table (``tables``: name -> (rows, dim)) within a budget of ``max_bytes``.

    Each table gets ``max_bytes * its fp32 bytes / all tables' fp32 bytes``, converted to rows at ``dim * 4 + 16``
    bytes per slot, capped at the table's rows and rounded up to whole sets, so ``nbytes`` may exceed ``max_bytes``
    by less than ``ways`` slots per table; ``max_bytes=0`` disables it. Tables of one width share one
    ``TableCache`` in which each owns its own sets, so a batch's ids of many tables are looked up and inserted in
    one set of vectorized operations.
    """

    def __init__(
        self, tables: Mapping[str, tuple[int, int]], *, max_bytes: int, policy: CachePolicy = "lru", ways: int = 8
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        _check_policy(policy)
        _check_ways(ways)
        for name, (rows, dim) in tables.items():
            if rows < 0 or dim < 1:
                raise ValueError(f"tables[{name!r}] must be (rows >= 0, dim >= 1), got {(rows, dim)}")
        total = sum(rows * dim * 4 for rows, dim in tables.values())
        self.ways = ways
        self._groups: dict[int, _Group] = {}
        self._group_of: dict[str, _Group] = {}
        space = IdSpace.of(tables) if tables else None
        for id_group in space.groups if space else ():
            dim, sets = id_group.dim, []
            for name in id_group.tables:
                rows = tables[name][0]
                share = max_bytes * rows * dim * 4 // total if total else 0
                sets.append(math.ceil(min(share // (dim * 4 + _METADATA_BYTES), rows) / ways))
            cache = TableCache(dim, sum(sets) * ways, policy=policy, ways=ways)
            group = _Group(cache, id_group, space, sets)
            self._groups[dim] = group
            self._group_of |= dict.fromkeys(id_group.tables, group)

    def lookup(self, tables: Sequence[str], counts: Sequence[int], ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hit [n], rows [n_hit, dim])`` for ``ids`` (unique within each table, >= 0): the first ``counts[0]``
        ids are of ``tables[0]``, the next ``counts[1]`` of ``tables[1]``, ...; all tables of one width."""
        group, table, tags, sets = self._place(tables, counts, ids)
        cacheable = torch.nonzero(sets >= 0).squeeze(1)
        hit = torch.zeros(ids.shape[0], dtype=torch.bool)
        found, rows = group.cache.lookup(tags.index_select(0, cacheable), sets.index_select(0, cacheable))
        hit[cacheable[found]] = True
        with group.lock:
            group.lookups.index_add_(0, table, torch.ones_like(table))
            group.hits.index_add_(0, table[hit], torch.ones_like(table[hit]))
        return hit, rows

    def insert(self, tables: Sequence[str], counts: Sequence[int], ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Cache ``rows[i]`` as the row of ``ids[i]``, the ids laid out as for ``lookup``."""
        group, _, tags, sets = self._place(tables, counts, ids)
        if rows.shape != (ids.shape[0], group.cache.dim):
            raise ValueError(f"rows must have shape {(ids.shape[0], group.cache.dim)}, got {tuple(rows.shape)}")
        cacheable = torch.nonzero(sets >= 0).squeeze(1)
        group.cache.insert(tags.index_select(0, cacheable), rows.index_select(0, cacheable),
                           sets.index_select(0, cacheable))

    def _place(self, tables: Sequence[str], counts: Sequence[int], ids: torch.Tensor
               ) -> tuple[_Group, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The group of ``tables`` and, per id, its table's index in the group, its tag and its set (-1 for a
        table without sets: not cached)."""
        if len(tables) != len(counts) or sum(counts) != ids.numel() or min(counts, default=0) < 0:
            raise ValueError(f"counts must give the number of ids of each of the {len(tables)} tables, got {counts}")
        if not tables:
            raise ValueError("tables must name at least one table")
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {list(ids.shape)}")
        group = self._group(tables[0])
        if any(self._group(name) is not group for name in tables):
            raise ValueError("tables of one lookup must have the same row width")
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"ids must be >= 0, got {int(ids.min())}")
        table = torch.repeat_interleave(torch.tensor([group.index[name] for name in tables], dtype=torch.int64),
                                        torch.tensor(counts, dtype=torch.int64))
        ids = ids.to(torch.int64)
        sets = group.sets.index_select(0, table)
        placed = group.set_start.index_select(0, table) + set_index(ids, 1 << 32) % sets.clamp(min=1)
        return group, table, ids + group.base.index_select(0, table), torch.where(sets > 0, placed, -1)

    def _group(self, name: str) -> _Group:
        try:
            return self._group_of[name]
        except KeyError:
            raise ValueError(f"unknown table name {name!r}; tables: {sorted(self._group_of)}") from None

    def clear(self, name: str | None = None) -> None:
        """Empty the cached rows of table ``name``, or of every table."""
        if name is None:
            for group in self._groups.values():
                group.cache.clear()
            return
        group = self._group(name)
        index = group.index[name]
        start = int(group.set_start[index])
        group.cache.clear(start, start + int(group.sets[index]))

    def stats(self) -> dict[str, tuple[int, int]]:
        """``{table: (hits, lookups)}``, counted in ids."""
        return {name: (int(group.hits[group.index[name]]), int(group.lookups[group.index[name]]))
                for name, group in self._group_of.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of the storage: rows, tags and priorities."""
        return sum(group.cache.nbytes for group in self._groups.values())

    @property
    def capacity_rows(self) -> dict[str, int]:
        """``{table: slots}`` (whole sets)."""
        return {name: int(group.sets[group.index[name]]) * self.ways for name, group in self._group_of.items()}
