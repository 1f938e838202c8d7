"""Synthetic requests with skewed counts and power-law (Zipf) categorical ids: Criteo-shaped DLRM batches
(``SyntheticRequests``) and batches of any served model's signature (``SignatureRequests``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from disagg.id_ranges import IdRange, torch_dtype
from disagg.signature import FLOAT_DATATYPES, INTEGER_DATATYPES, VARIABLE, InputSignature, ModelSignature
from disagg.spec import DLRMSpec


def log_counts(rng: np.random.Generator, means: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``log1p`` of log-normal counts (Criteo's count preprocessing), float64 of ``shape``: ``floor`` of a log-normal
    draw with log-mean ``means`` (broadcast to ``shape``) and log-sd 1.5."""
    return np.log1p(np.floor(rng.lognormal(means, 1.5, shape)))


class PowerLawIds:
    """Power-law ids of tables with ``table_sizes`` rows: rank r (0-based) is drawn with P ~ (r + 1)^-zipf_alpha by a
    closed-form inverse CDF and mapped to an id by a bijection per table (``rank * multiplier + offset`` modulo the
    rows, both drawn from ``rng`` here), so hot ids differ per table and nothing of table size is materialised
    (tables up to 2**31 rows)."""

    def __init__(self, table_sizes: Sequence[int], rng: np.random.Generator, zipf_alpha: float) -> None:
        if zipf_alpha <= 0:
            raise ValueError(f"zipf_alpha must be > 0, got {zipf_alpha}")
        self.table_sizes = tuple(table_sizes)
        self.zipf_alpha = zipf_alpha
        self.multipliers = [_coprime_multiplier(rng, rows) for rows in self.table_sizes]
        self.offsets = [int(rng.integers(rows)) for rows in self.table_sizes]

    def draw(self, table: int, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """int64 ids of table ``table`` (its index in ``table_sizes``), of ``shape``, from ``rng``."""
        rows = self.table_sizes[table]
        return (self._ranks(rows, rng, shape) * self.multipliers[table] + self.offsets[table]) % rows

    def _ranks(self, table_rows: int, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """0-based ranks in [0, table_rows): inverse CDF of a power law (exponent ``zipf_alpha``) on [1, rows + 1)."""
        uniform = rng.random(shape)
        exponent = 1.0 - self.zipf_alpha
        if abs(exponent) < 1e-9:
            values = np.exp(uniform * math.log(table_rows + 1))
        else:
            values = (1.0 + uniform * ((table_rows + 1) ** exponent - 1.0)) ** (1.0 / exponent)
        return np.clip(values.astype(np.int64) - 1, 0, table_rows - 1)


def _coprime_multiplier(rng: np.random.Generator, table_rows: int) -> int:
    """A random multiplier coprime to ``table_rows``, so ``rank * multiplier % rows`` is a bijection."""
    while True:
        multiplier = int(rng.integers(1, max(table_rows, 2)))
        if math.gcd(multiplier, table_rows) == 1:
            return multiplier


class SyntheticRequests:
    """Seeded generator of ``(dense, sparse)`` batches for a DLRM ``spec``; the same seed gives the same batches.

    Dense: ``log_counts`` with a seeded mean per feature, float32 [rows, num_dense]. Sparse: int64
    [rows, num_tables, max_hotness], bags of 1..max_hotness ids then -1 padding; ids follow a power law per table
    (``PowerLawIds``). ``seed`` fixes the distribution and, by default, the rows; ``stream`` draws other rows of the
    same distribution (e.g. training and held-out data).
    """

    def __init__(self, spec: DLRMSpec, *, seed: int = 0, zipf_alpha: float = 1.05, max_hotness: int = 1,
                 stream: int | None = None) -> None:
        if max_hotness < 1:
            raise ValueError(f"max_hotness must be >= 1, got {max_hotness}")
        self.spec = spec
        self.max_hotness = max_hotness
        self._rng = np.random.default_rng(seed)
        self._count_means = self._rng.uniform(0.0, 3.0, spec.num_dense)
        self.power_law = PowerLawIds(spec.table_sizes, self._rng, zipf_alpha)
        if stream is not None:
            self._rng = np.random.default_rng([seed, stream, 0])

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``rows`` requests: dense float32 [rows, num_dense], sparse int64 [rows, num_tables, H]."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        dense = log_counts(self._rng, self._count_means, (rows, self.spec.num_dense)).astype(np.float32)
        shape = (rows, self.max_hotness)
        ids = np.stack([self.power_law.draw(table, self._rng, shape) for table in range(self.spec.num_tables)], axis=1)
        hotness = self._rng.integers(1, self.max_hotness + 1, (rows, self.spec.num_tables, 1))
        ids[np.arange(self.max_hotness) >= hotness] = -1
        return torch.from_numpy(dense), torch.from_numpy(ids)


def _positions(tensor: InputSignature) -> tuple[int, ...]:
    """``tensor``'s shape with 1 along the batch and the variable dimensions: one entry per feature position."""
    return tuple(1 if axis == 0 or size == VARIABLE else size for axis, size in enumerate(tensor.shape))


class SignatureRequests:
    """Seeded generator of batches of a model's inputs (``signature``), keyed by wire name, each of the input's
    datatype with ``variable_size`` along every variable dimension; the same seed gives the same batches.

    Float inputs: ``log_counts`` with a seeded mean per position of the fixed dimensions (as ``SyntheticRequests``'
    dense features: non-negative, skewed). Integer inputs: each position draws the power-law ids (``PowerLawIds``)
    of the table its ``id_ranges`` entry names, one seeded bijection per table shared by every position and input
    that indexes it (ids within ``[0, rows)``); a position that indexes no table is 0. BOOL inputs: fair random bits.
    ``seed`` and ``stream`` as for ``SyntheticRequests``. An integer input without an id range (the model
    transforms its ids, e.g. hashes them, so which ids are valid is unknown) is a ValueError naming it.
    """

    def __init__(self, signature: ModelSignature, id_ranges: Mapping[str, IdRange], *, seed: int = 0,
                 zipf_alpha: float = 1.05, variable_size: int = 1, stream: int | None = None) -> None:
        if variable_size < 1:
            raise ValueError(f"variable_size must be >= 1, got {variable_size}")
        integers = [tensor for tensor in signature.inputs if tensor.datatype in INTEGER_DATATYPES]
        if unranged := [tensor.name for tensor in integers if tensor.name not in id_ranges]:
            raise ValueError(f"integer input {unranged[0]!r} has no id range: the model does not look its ids up as "
                             "sent (it hashes or offsets them?), so which ids are valid is unknown; send such a model "
                             "requests from a workload file")
        self.signature = signature
        self.variable_size = variable_size
        self._ranges = {tensor.name: id_ranges[tensor.name] for tensor in integers}
        table_rows: dict[str, int] = {}
        for ranged in self._ranges.values():
            for table, rows in zip(ranged.tables.flat, ranged.high.flat, strict=True):
                if table is not None:
                    table_rows.setdefault(table, int(rows))
        self._table_index = {table: index for index, table in enumerate(table_rows)}
        self._rng = np.random.default_rng(seed)
        self._means = {tensor.name: self._rng.uniform(0.0, 3.0, _positions(tensor)) for tensor in signature.inputs
                       if tensor.datatype in FLOAT_DATATYPES}
        self.power_law = PowerLawIds(list(table_rows.values()), self._rng, zipf_alpha)
        if stream is not None:
            self._rng = np.random.default_rng([seed, stream, 0])

    def batch(self, rows: int) -> dict[str, torch.Tensor]:
        """The next ``rows`` requests: one tensor per input, by wire name, in the signature's order."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        batch = {}
        for tensor in self.signature.inputs:
            shape = (rows, *(self.variable_size if size == VARIABLE else size for size in tensor.shape[1:]))
            if tensor.datatype in FLOAT_DATATYPES:
                values = log_counts(self._rng, self._means[tensor.name], shape)
            elif tensor.datatype in INTEGER_DATATYPES:
                values = self._ids(self._ranges[tensor.name], shape)
            else:
                values = self._rng.random(shape) < 0.5
            batch[tensor.name] = torch.from_numpy(values).to(torch_dtype(tensor.datatype))
        return batch

    def _ids(self, ranged: IdRange, shape: tuple[int, ...]) -> np.ndarray:
        tables = np.broadcast_to(ranged.tables, shape)
        ids = np.zeros(shape, np.int64)
        for table in dict.fromkeys(ranged.tables.flat):
            if table is not None:
                where = tables == table
                ids[where] = self.power_law.draw(self._table_index[table], self._rng, (int(where.sum()),))
        return ids
