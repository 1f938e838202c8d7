"""Embedding tables served by rows: how they are laid out over shards and stored, and one shard built alone.

A *table* is an ``nn.Embedding`` / ``nn.EmbeddingBag`` of a model, named by its qualified module name. A
``TableLayout`` plans which *slices* (whole tables, or contiguous id ranges of big tables) each shard holds and in
which storage dtype; ``build_embedding_shard`` materializes only one shard's tables of a model's structure, keeps its
slices (``RowStore``) and frees the rest, so a shard process never holds another shard's rows. The dense side
computes the same plan and every shard's ``version`` from the config alone, and checks the version shards report.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import torch
from torch import nn

from disagg.config import StorageDtype

if TYPE_CHECKING:
    from disagg.model_source import ModelSource

STORAGE_DTYPES: tuple[str, ...] = get_args(StorageDtype)

#: int8 storage: 256 levels per row between the row's minimum (``bias``) and maximum.
_LEVELS = 255
#: Bytes per row of int8 storage besides the values: a float16 scale and a float16 bias.
_INT8_ROW_OVERHEAD = 4
_EMBEDDING_MODULES = (nn.Embedding, nn.EmbeddingBag)
#: Bumped when what a version covers (or how it is stored) changes.
_VERSION_FORMAT = "table-rows/1"


def _check_storage_dtype(field_name: str, dtype: str) -> None:
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"{field_name}: unknown storage dtype {dtype!r}; known: {', '.join(STORAGE_DTYPES)}")


def storage_bytes(rows: int, dim: int, dtype: StorageDtype) -> int:
    """Bytes that ``rows`` rows of width ``dim`` take in storage ``dtype`` (``RowStore.nbytes``)."""
    if dtype == "int8":
        return rows * (dim + _INT8_ROW_OVERHEAD)
    return rows * dim * (4 if dtype == "float32" else 2)


@dataclass(frozen=True)
class TableSlice:
    """Rows ``[row_start, row_stop)`` of table ``table`` (``table_rows`` rows of width ``dim``)."""

    table: str
    row_start: int
    row_stop: int
    table_rows: int
    dim: int

    def __post_init__(self) -> None:
        if not 0 <= self.row_start < self.row_stop <= self.table_rows:
            raise ValueError(
                f"slice of {self.table!r}: rows [{self.row_start}, {self.row_stop}) must be a non-empty range "
                f"within the table's {self.table_rows} rows"
            )
        if self.dim < 1:
            raise ValueError(f"slice of {self.table!r}: dim must be >= 1, got {self.dim}")

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def whole(self) -> bool:
        return self.row_start == 0 and self.row_stop == self.table_rows

    @property
    def name(self) -> str:
        """The gRPC input and output name: ``table`` for a whole table, else ``table[start:stop]``."""
        return self.table if self.whole else f"{self.table}[{self.row_start}:{self.row_stop}]"


@dataclass(frozen=True)
class TableLayout:
    """How tables are spread over ``num_shards`` shards and stored.

    A table whose float32 bytes exceed ``row_wise_min_bytes`` (None: never) is split row-wise over every shard;
    the others stay whole. Tables are stored in ``storage_dtype`` unless ``table_storage`` names their own.
    """

    num_shards: int = 1
    row_wise_min_bytes: int | None = None
    storage_dtype: StorageDtype = "float32"
    table_storage: Mapping[str, StorageDtype] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.row_wise_min_bytes is not None and self.row_wise_min_bytes < 0:
            raise ValueError(f"row_wise_min_bytes must be >= 0 or None, got {self.row_wise_min_bytes}")
        _check_storage_dtype("storage_dtype", self.storage_dtype)
        for table, dtype in self.table_storage.items():
            _check_storage_dtype(f"table_storage[{table!r}]", dtype)
        object.__setattr__(self, "table_storage", dict(self.table_storage))

    def storage_of(self, table: str) -> StorageDtype:
        """The storage dtype of ``table``."""
        return self.table_storage.get(table, self.storage_dtype)

    def plan(self, tables: Mapping[str, tuple[int, int]]) -> list[tuple[TableSlice, ...]]:
        """The slices of every shard, from ``{table: (rows, dim)}`` (``embedding_tables``); deterministic.

        A row-wise table is cut into ``num_shards`` contiguous ranges whose sizes differ by at most one, range
        ``i`` on shard ``i`` (a table of fewer rows than shards leaves the last shards without one). Whole
        tables then go, largest storage bytes first (earlier tables first on ties), to the shard holding the
        fewest storage bytes (lowest index on ties). Within a shard, slices follow the order of ``tables``.
        ValueError when ``table_storage`` names a table not in ``tables`` or a shard would hold nothing.
        """
        if not tables:
            raise ValueError("there are no embedding tables to plan")
        unknown = sorted(set(self.table_storage) - tables.keys())
        if unknown:
            raise ValueError(f"table_storage names no table: {unknown}; known tables: {', '.join(tables)}")
        order = {table: position for position, table in enumerate(tables)}
        loads = [0] * self.num_shards
        members: list[list[TableSlice]] = [[] for _ in range(self.num_shards)]
        whole: list[TableSlice] = []
        for table, (rows, dim) in tables.items():
            if self.row_wise_min_bytes is None or rows * dim * 4 <= self.row_wise_min_bytes:
                whole.append(TableSlice(table, 0, rows, rows, dim))
                continue
            for shard in range(self.num_shards):
                start, stop = (-(-shard * rows // self.num_shards) for shard in (shard, shard + 1))  # ceil
                if start < stop:
                    members[shard].append(TableSlice(table, start, stop, rows, dim))
                    loads[shard] += self._bytes(members[shard][-1])
        for piece in sorted(whole, key=lambda piece: (-self._bytes(piece), order[piece.table])):
            target = loads.index(min(loads))
            members[target].append(piece)
            loads[target] += self._bytes(piece)
        empty = [shard for shard, held in enumerate(members) if not held]
        if empty:
            raise ValueError(
                f"num_shards={self.num_shards} leaves shards {empty} empty: there are only {len(tables)} tables "
                f"and {sum(map(len, members))} slices; use fewer shards, or a lower row_wise_min_bytes to split big "
                "tables row-wise over every shard"
            )
        return [tuple(sorted(held, key=lambda piece: (order[piece.table], piece.row_start))) for held in members]

    def _bytes(self, piece: TableSlice) -> int:
        return storage_bytes(piece.rows, piece.dim, self.storage_of(piece.table))


class RowStore:
    """The rows of one slice in a storage dtype: float32, float16, or int8 row-wise.

    int8 is FBGEMM's 8-bit row-wise layout for inference: each row is uint8 levels ``q`` with a float16 ``scale``
    and ``bias`` (its minimum, rounded down to float16), and reads back as ``q * scale + bias`` in float32, within
    ``scale / 2`` of the original value; a constant row comes back as its value rounded to float16 (exactly for
    values float16 holds, zero rows among them).
    """

    def __init__(self, piece: TableSlice, weight: torch.Tensor, dtype: StorageDtype) -> None:
        """Stores ``weight`` (float32 [piece.rows, piece.dim], the slice's rows) in ``dtype``, copying it."""
        _check_storage_dtype("dtype", dtype)
        if tuple(weight.shape) != (piece.rows, piece.dim):
            raise ValueError(f"{piece.name}: weight is {list(weight.shape)}, the slice is [{piece.rows}, {piece.dim}]")
        self.slice = piece
        self.dtype = dtype
        weight = weight.detach().to(torch.float32)
        self.scale: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        if dtype == "int8":
            self.values, self.scale, self.bias = _quantize_rows(piece.name, weight)
        else:
            self.values = weight.to(torch.float16) if dtype == "float16" else weight.clone()

    @property
    def nbytes(self) -> int:
        """Bytes held (values, and int8's scales and biases)."""
        return sum(t.nbytes for t in (self.values, self.scale, self.bias) if t is not None)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``local_ids`` (1-D int32/int64, each in ``[0, rows)``, unchecked) as float32 [n, dim]."""
        values = self.values.index_select(0, local_ids)
        if self.scale is None:
            return values.to(torch.float32)
        scale = self.scale.index_select(0, local_ids).to(torch.float32)
        bias = self.bias.index_select(0, local_ids).to(torch.float32)
        return torch.addcmul(bias, values.to(torch.float32), scale)

    def lookup_into(self, local_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Writes rows ``local_ids`` into ``out`` ([n, dim], any floating dtype): one gather when the rows are stored
        in ``out``'s dtype, else ``lookup``'s float32 rows cast into it. IndexError/RuntimeError for an id outside
        the rows."""
        if self.scale is None and self.values.dtype == out.dtype:
            torch.index_select(self.values, 0, local_ids, out=out)
        else:
            out.copy_(self.lookup(local_ids))


def _quantize_rows(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 levels [rows, dim], float16 scale and bias [rows, 1] of float32 ``weight``.

    The bias is the row minimum rounded down to float16 and the scale covers the rest of the row's range rounded
    up, so every level is in [0, 255] and within half a scale of the value.
    """
    if not bool(torch.isfinite(weight).all()) or bool((weight.abs() > torch.finfo(torch.float16).max).any()):
        raise ValueError(f"{name}: int8 storage needs finite values within float16's range (its scale and bias)")
    low = weight.amin(dim=1, keepdim=True)
    high = weight.amax(dim=1, keepdim=True)
    constant = high == low
    bias = low.to(torch.float16)
    bias = torch.where(~constant & (bias.to(torch.float32) > low), _next_half(bias, -1), bias)
    span = (high - bias.to(torch.float32)) / _LEVELS
    scale = span.to(torch.float16)
    scale = torch.where(scale.to(torch.float32) < span, _next_half(scale, 1), scale)
    scale = torch.where(constant, torch.zeros_like(scale), scale)
    levels = ((weight - bias.to(torch.float32)) / scale.to(torch.float32)).round().clamp(0, _LEVELS)
    levels = torch.where(constant, torch.zeros_like(levels), levels)  # 0/0 there: the row is its bias
    return levels.to(torch.uint8), scale, bias


def _next_half(values: torch.Tensor, direction: int) -> torch.Tensor:
    """The float16 neighbour of each of ``values`` towards +inf (``direction`` 1) or -inf (-1)."""
    return torch.nextafter(values, torch.full_like(values, direction * float("inf")))


def embedding_tables(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{table: (rows, dim)}`` for every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model``, in
    ``named_modules`` order (meta modules are fine)."""
    return {
        name: (module.weight.shape[0], module.weight.shape[1])
        for name, module in model.named_modules()
        if isinstance(module, _EMBEDDING_MODULES)
    }


def weights_source(seed: int, weights_path: str | os.PathLike | None) -> str:
    """What a model's values come from: ``seed:N``, or ``file:<blake2b of the file>`` for a weights file (the seed
    is then unused). The digest is cached per (path, size, modification time)."""
    if weights_path is None:
        return f"seed:{seed}"
    path = Path(weights_path).resolve()
    stat = path.stat()
    return f"file:{_file_digest(str(path), stat.st_size, stat.st_mtime_ns)}"


@lru_cache(maxsize=32)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def shard_version(source: str, slices: Sequence[TableSlice], layout: TableLayout) -> str:
    """Hex digest of the values a shard serves: ``source`` (``weights_source``), every slice and its storage dtype.

    Equal configs give equal versions, so the dense side knows every shard's version from its config alone.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{_VERSION_FORMAT}\n{source}\n".encode())
    for piece in slices:
        digest.update(f"{piece.name}/{piece.table_rows}x{piece.dim}/{layout.storage_of(piece.table)}\n".encode())
    return digest.hexdigest()


class TableLookup:
    """``lookup(**{slice name: local ids})`` -> ``{slice name: float32 rows [n, dim]}`` over a shard's stores;
    ``gather`` writes them, in any floating dtype, into one buffer.

    Every input must be 1-D int32/int64 with ids in ``[0, slice rows)``; ValueError naming the input otherwise.
    """

    def __init__(self, stores: Sequence[RowStore]) -> None:
        self._stores = {store.slice.name: store for store in stores}
        #: The row width of each store, in order.
        self.widths = tuple(store.slice.dim for store in stores)

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        missing = [name for name in self._stores if name not in inputs]
        unknown = [name for name in inputs if name not in self._stores]
        if missing or unknown:
            raise ValueError(f"inputs: missing {missing}, unknown {unknown}; expected {list(self._stores)}")
        rows = {}
        for name, store in self._stores.items():
            ids = _checked_ids(name, inputs[name])
            with _named_range_errors(name, ids, store):
                rows[name] = store.lookup(ids)
        return rows

    def gather(self, ids: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Every store's rows of ``ids[i]`` (store ``i``'s local ids) in one 1-D ``dtype`` buffer, store after store,
        each written once (``RowStore.lookup_into``); ValueError naming the slice as ``__call__`` does."""
        if len(ids) != len(self._stores):
            raise ValueError(f"ids of {len(ids)} slices given; the shard holds {len(self._stores)}")
        stores = self._stores.values()
        out = torch.empty(sum(part.shape[0] * store.slice.dim for part, store in zip(ids, stores, strict=True)),
                          dtype=dtype)
        start = 0
        for part, store in zip(ids, stores, strict=True):
            name = store.slice.name
            part = _checked_ids(name, part)
            stop = start + part.shape[0] * store.slice.dim
            with _named_range_errors(name, part, store):
                store.lookup_into(part, out[start:stop].view(part.shape[0], store.slice.dim))
            start = stop
        return out


def _checked_ids(name: str, ids: torch.Tensor) -> torch.Tensor:
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        raise ValueError(
            f"input {name!r}: ids must be a 1-D int32 or int64 tensor, got "
            f"{str(ids.dtype).removeprefix('torch.')}{list(ids.shape)}"
        )
    return ids


@contextmanager
def _named_range_errors(name: str, ids: torch.Tensor, store: RowStore) -> Iterator[None]:
    """index_select checks every id against the rows (no pass of our own over the ids); its error for an id
    outside them becomes a ValueError naming the input, the id and the valid range."""
    try:
        yield
    except (IndexError, RuntimeError):
        low, high = int(ids.min()), int(ids.max())
        if low >= 0 and high < store.slice.rows:  # not a bad id: the error is the store's own
            raise
        raise ValueError(f"input {name!r}: id {low if low < 0 else high} is out of range; valid ids are "
                         f"[0, {store.slice.rows})") from None


@dataclass(frozen=True)
class TableShard:
    """One shard's slices and their stores; ``module(**{slice name: local ids})`` returns their float32 rows.

    Input and output names are the slice names; ``version`` is ``shard_version`` of what it serves. It is what
    ``disagg.rpc.server.EmbeddingServer`` hosts.
    """

    index: int
    slices: tuple[TableSlice, ...]
    stores: tuple[RowStore, ...]
    version: str
    module: TableLookup = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if [store.slice for store in self.stores] != list(self.slices):
            raise ValueError(f"shard {self.index}: stores must hold exactly its slices, in order")
        object.__setattr__(self, "module", TableLookup(self.stores))

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(piece.name for piece in self.slices)

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.input_names

    @property
    def parameter_bytes(self) -> int:
        """Bytes the stores hold."""
        return sum(store.nbytes for store in self.stores)


def build_embedding_shard(source: ModelSource, index: int, layout: TableLayout) -> TableShard:
    """Shard ``index`` of ``layout.plan`` over the model's tables, holding only its own slices.

    The model's structure is built (``source.skeleton()``) and each of the shard's tables is materialized alone (the
    full model's values: seeded, or read from the weights file), sliced, converted to its storage dtype and freed
    before the next, so the process never holds another shard's tables nor two full tables at once.
    """
    if not 0 <= index < layout.num_shards:
        raise ValueError(f"shard index must be in [0, {layout.num_shards}), got {index}")
    model = source.skeleton()
    slices = layout.plan(embedding_tables(model))[index]
    stores: list[RowStore] = []
    for table in dict.fromkeys(piece.table for piece in slices):
        source.materialize(model, only=[table])
        layer = model.get_submodule(table)
        with torch.no_grad():
            for piece in (piece for piece in slices if piece.table == table):
                rows = layer.weight[piece.row_start : piece.row_stop]
                stores.append(RowStore(piece, rows, layout.storage_of(table)))
        layer.to_empty(device="meta")
    return TableShard(index, slices, tuple(stores), shard_version(source.version_source, slices, layout))
