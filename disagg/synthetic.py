"""Synthetic DLRM requests shaped like Criteo traffic: skewed counts and power-law (Zipf) categorical ids."""

from __future__ import annotations

import math

import numpy as np
import torch

from disagg.spec import DLRMSpec


class SyntheticRequests:
    """Seeded generator of ``(dense, sparse)`` batches for a DLRM ``spec``; the same seed gives the same batches.

    Dense: ``log1p`` of log-normal counts (Criteo's count preprocessing), float32 [rows, num_dense]. Sparse: int64
    [rows, num_tables, max_hotness], bags of 1..max_hotness ids then -1 padding; ids follow a power law
    (P(rank r) ~ r^-zipf_alpha) mapped to ids by a seeded per-table bijection, so hot ids differ per table and
    nothing of table size is materialised (tables up to 2**31 rows). ``seed`` fixes the distribution and, by
    default, the rows; ``stream`` draws other rows of the same distribution (e.g. training and held-out data).
    """

    def __init__(self, spec: DLRMSpec, *, seed: int = 0, zipf_alpha: float = 1.05, max_hotness: int = 1,
                 stream: int | None = None) -> None:
        if zipf_alpha <= 0:
            raise ValueError(f"zipf_alpha must be > 0, got {zipf_alpha}")
        if max_hotness < 1:
            raise ValueError(f"max_hotness must be >= 1, got {max_hotness}")
        self.spec = spec
        self.zipf_alpha = zipf_alpha
        self.max_hotness = max_hotness
        self._rng = np.random.default_rng(seed)
        self._count_means = self._rng.uniform(0.0, 3.0, spec.num_dense)
        self._multipliers = [self._coprime_multiplier(rows) for rows in spec.table_sizes]
        self._offsets = [int(self._rng.integers(rows)) for rows in spec.table_sizes]
        if stream is not None:
            self._rng = np.random.default_rng([seed, stream, 0])

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``rows`` requests: dense float32 [rows, num_dense], sparse int64 [rows, num_tables, H]."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        counts = np.floor(self._rng.lognormal(self._count_means, 1.5, (rows, self.spec.num_dense)))
        dense = np.log1p(counts).astype(np.float32)
        shape = (rows, self.max_hotness)
        ids = np.stack(
            [
                (self._zipf_ranks(table_rows, shape) * multiplier + offset) % table_rows
                for table_rows, multiplier, offset in zip(
                    self.spec.table_sizes, self._multipliers, self._offsets, strict=True
                )
            ],
            axis=1,
        )
        hotness = self._rng.integers(1, self.max_hotness + 1, (rows, self.spec.num_tables, 1))
        ids[np.arange(self.max_hotness) >= hotness] = -1
        return torch.from_numpy(dense), torch.from_numpy(ids)

    def _zipf_ranks(self, table_rows: int, shape: tuple[int, ...]) -> np.ndarray:
        """0-based ranks in [0, table_rows): inverse CDF of a power law (exponent ``zipf_alpha``) on [1, rows + 1)."""
        uniform = self._rng.random(shape)
        exponent = 1.0 - self.zipf_alpha
        if abs(exponent) < 1e-9:
            values = np.exp(uniform * math.log(table_rows + 1))
        else:
            values = (1.0 + uniform * ((table_rows + 1) ** exponent - 1.0)) ** (1.0 / exponent)
        return np.clip(values.astype(np.int64) - 1, 0, table_rows - 1)

    def _coprime_multiplier(self, table_rows: int) -> int:
        """A random multiplier coprime to ``table_rows``, so ``rank * multiplier % rows`` is a bijection."""
        while True:
            multiplier = int(self._rng.integers(1, max(table_rows, 2)))
            if math.gcd(multiplier, table_rows) == 1:
                return multiplier
