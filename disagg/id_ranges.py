"""Which table each position of an integer input indexes, read from the model's graph, and the shapes probes use.

``id_ranges`` feeds position codes through the lookups' id graph (``EmbeddingLookups.ids``): an id that reaches a
lookup unchanged (or after clamping -1) maps its position to that lookup's table. The API checks ids against
these ranges and the request generators draw ids within them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from disagg.partition import EmbeddingLookups
from disagg.signature import EMPTY_SLOT, INTEGER_DATATYPES, VARIABLE, InputSignature, ModelSignature

#: Sizes probes give the batch and the variable dimensions.
PROBE_BATCH, PROBE_VARIABLE = 2, 3
_TORCH_DTYPES = {"BOOL": torch.bool, "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16,
                 "FP32": torch.float32, "FP64": torch.float64}


def torch_dtype(datatype: str) -> torch.dtype:
    """The torch element type of an input or output datatype."""
    return _TORCH_DTYPES[datatype]


def probe_shape(tensor: InputSignature, batch: int = PROBE_BATCH, variable: int = PROBE_VARIABLE) -> tuple[int, ...]:
    """``tensor``'s shape with ``batch`` rows and ``variable`` for every other -1."""
    return (batch, *(variable if size == VARIABLE else size for size in tensor.shape[1:]))


@dataclass(frozen=True)
class IdRange:
    """Valid ids of an integer input, per position of its non-variable dimensions (``high`` and ``tables`` have the
    input's rank, 1 along the batch and the variable dimensions): ``[low, high)``, ``low`` -1 where the model reads
    -1 as an empty slot. ``tables[...]`` names the table a position indexes (its rows are ``high``)."""

    low: int
    high: np.ndarray
    tables: np.ndarray


#: Probe ids: position p of an input is fed ``base + stride * p`` in each probe; an id that decodes to the same
#: position in both reached its lookup unchanged (an offset or a scale would have to fit both strides).
_PROBES = ((1_000_003, 7), (2_000_029, 11))


def id_ranges(lookups: EmbeddingLookups, signature: ModelSignature) -> dict[str, IdRange]:
    """The table each position of each integer input feeds, found by feeding position codes through the lookups'
    id graph: an id that reaches a lookup unchanged (or after -1 clamping) maps its position to that lookup's table;
    a position feeding several tables takes the smallest (the first looked up on a tie). Inputs whose ids the model
    transforms (hashing, offsets) get no range, positions no lookup reads unchanged no table (``None``); the lookups
    check their ids at run time."""
    ranges = {}
    zeros = {t.forward_argument: torch.zeros(probe_shape(t, batch=1), dtype=torch_dtype(t.datatype))
             for t in signature.inputs if t.forward_argument in lookups.inputs}
    for tensor in signature.inputs:
        if tensor.datatype not in INTEGER_DATATYPES or tensor.forward_argument not in lookups.inputs:
            continue
        shape = probe_shape(tensor, batch=1)
        first, second = (_positions(lookups, zeros, tensor, shape, base, stride) for base, stride in _PROBES)
        table_of = np.full(math.prod(shape), None, dtype=object)
        reached = []
        for op, positions in first.items():
            positions = positions[(positions >= 0) & (positions == second[op])]
            if not positions.size:
                continue
            reached.append(op)
            table = lookups.op_tables[op]
            for position in np.unique(positions):
                current = table_of[position]
                if current is None or lookups.tables[table][0] < lookups.tables[current][0]:
                    table_of[position] = table
        if not reached:
            continue
        empty = lookups.ids(**{**zeros, tensor.forward_argument: torch.full(shape, EMPTY_SLOT,
                                                                            dtype=torch_dtype(tensor.datatype))})
        low = EMPTY_SLOT if all(int(empty[op].min()) >= 0 for op in reached) else 0
        ranges[tensor.name] = IdRange(low, *_fold(table_of.reshape(shape), tensor, lookups))
    return ranges


def _positions(lookups: EmbeddingLookups, zeros: dict[str, torch.Tensor], tensor: InputSignature,
               shape: tuple[int, ...], base: int, stride: int) -> dict[str, np.ndarray]:
    """Per op, the input position each id it is fed decodes to when position p of ``tensor`` holds
    ``base + stride * p`` (the other inputs zeros); -1 where an id decodes to none."""
    count = math.prod(shape)
    codes = torch.arange(count, dtype=torch.int64).mul(stride).add(base).reshape(shape)
    fed = lookups.ids(**{**zeros, tensor.forward_argument: codes.to(torch_dtype(tensor.datatype))})
    decoded = {}
    for op, ids in fed.items():
        offsets = ids.reshape(-1).to(torch.int64).numpy() - base
        hit = (offsets >= 0) & (offsets % stride == 0) & (offsets // stride < count)
        decoded[op] = np.where(hit, offsets // stride, -1)
    return decoded


def _fold(table_of: np.ndarray, tensor: InputSignature, lookups: EmbeddingLookups) -> tuple[np.ndarray, np.ndarray]:
    """Per-position tables folded over the variable dimensions (the smallest table where positions differ)."""
    rows = np.vectorize(lambda table: np.iinfo(np.int64).max if table is None else lookups.tables[table][0],
                        otypes=[np.int64])
    tables = table_of
    for axis, size in enumerate(tensor.shape):
        if axis > 0 and size == VARIABLE:
            tables = np.take_along_axis(tables, rows(tables).argmin(axis=axis, keepdims=True), axis=axis)
    return rows(tables), tables
