"""Replay searchers against full-grid profiles, leave-one-model-out, over several seeds.

A trial's outcome is looked up on the recorded surface, not measured. Trials-to-X is the 1-based trial count at
which the best value so far first reaches X, or the space's size if no run reaches it (docs/AUTOCONFIG.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoconfig.bank import BankEntry
from autoconfig.searchers.base import Observation, Searcher, SearcherFactory


@dataclass(frozen=True)
class SearcherReport:
    """One searcher's runs: ``best_so_far[model, seed, trial]`` is the best value so far over the model's optimum
    (0 before any feasible trial; held after the run stopped). Trial counts are ``[model, seed]``."""

    best_so_far: np.ndarray
    space_sizes: tuple[int, ...]
    tolerance: float

    def trials_to(self, levels: Sequence[float]) -> np.ndarray:
        """Trials each run took to reach ``levels[model]`` of its model's optimum (the space's size if never)."""
        return np.array([[_first_reaching(curve, level, size) for curve in runs]
                         for runs, level, size in zip(self.best_so_far, levels, self.space_sizes, strict=True)])

    @property
    def trials_to_optimum(self) -> np.ndarray:
        return self.trials_to([1.0] * len(self.space_sizes))

    @property
    def trials_to_within(self) -> np.ndarray:
        """Trials to within ``tolerance`` of the optimum."""
        return self.trials_to([1.0 - self.tolerance] * len(self.space_sizes))

    def summary(self) -> dict[str, float]:
        """Median, p90 and mean of both trial counts over models x seeds."""
        stats = {}
        for label, counts in (("optimum", self.trials_to_optimum), ("within", self.trials_to_within)):
            stats[f"{label}_median"] = float(np.median(counts))
            stats[f"{label}_p90"] = float(np.percentile(counts, 90))
            stats[f"{label}_mean"] = float(np.mean(counts))
        return stats


@dataclass(frozen=True)
class ReplayResult:
    models: tuple[str, ...]
    space_sizes: tuple[int, ...]
    seeds: tuple[int, ...]
    tolerance: float
    searchers: dict[str, SearcherReport]

    def trials_to_within(self, searcher: str, tolerances: Sequence[float]) -> np.ndarray:
        """Trials each run of ``searcher`` took to within ``tolerances[model]`` of that model's optimum, e.g. its
        measurement noise (``[model, seed]``; the space's size when never reached)."""
        return self.searchers[searcher].trials_to([1.0 - tolerance for tolerance in tolerances])


def replay(
    factories: Mapping[str, SearcherFactory],
    entries: Sequence[BankEntry],
    *,
    seeds: Sequence[int],
    budget: int | None = None,
    tolerance: float = 0.05,
    on_run: Callable[[str, str, int], None] | None = None,
) -> ReplayResult:
    """Run every searcher on every entry (the others as its prior) for every seed.

    ``budget`` caps trials per run (default: the whole space). ``on_run(searcher, model, seed)`` is called
    after each run, e.g. to advance a progress bar.
    """
    if len(entries) < 2:
        raise ValueError("leave-one-model-out needs at least two bank entries")
    surfaces = [entry.surface()[1] for entry in entries]
    for entry, values in zip(entries, surfaces, strict=True):
        if not np.nan_to_num(values, nan=0.0).max() > 0:
            raise ValueError(f"{entry.name}: no configuration has a positive objective")
    length = max(min(budget or entry.space.size, entry.space.size) for entry in entries)
    sizes = tuple(entry.space.size for entry in entries)
    reports = {}
    for name, factory in factories.items():
        shape = (len(entries), len(seeds))
        curves = np.zeros((*shape, length))
        for m, (entry, values) in enumerate(zip(entries, surfaces, strict=True)):
            prior = [other for i, other in enumerate(entries) if i != m]
            for s, seed in enumerate(seeds):
                searcher = factory(entry.space, seed, prior, target=entry.model.model_dump())
                curve = _run(searcher, values, min(budget or entry.space.size, entry.space.size))
                curves[m, s, : len(curve)] = curve
                curves[m, s, len(curve) :] = curve[-1]
                if on_run is not None:
                    on_run(name, entry.name, seed)
        reports[name] = SearcherReport(curves, sizes, tolerance)
    return ReplayResult(
        models=tuple(e.name for e in entries),
        space_sizes=sizes,
        seeds=tuple(seeds),
        tolerance=tolerance,
        searchers=reports,
    )


def _run(searcher: Searcher, values: np.ndarray, budget: int) -> np.ndarray:
    """Best value so far / optimum after each trial, stopping once the optimum is observed."""
    optimum = np.nanmax(values)
    history: list[Observation] = []
    curve = []
    best = 0.0
    for _ in range(budget):
        config = searcher.suggest(history)
        value = values[searcher.space.index(config)]
        history.append(Observation(config, None if np.isnan(value) else float(value)))
        best = max(best, 0.0 if np.isnan(value) else float(value))
        curve.append(best / optimum)
        if best >= optimum:
            break
    return np.array(curve)


def _first_reaching(curve: np.ndarray, level: float, cap: int) -> int:
    reached = np.flatnonzero(curve >= level)
    return int(reached[0]) + 1 if reached.size else cap
