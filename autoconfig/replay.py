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
    (0 before any feasible trial; held after the run stopped) and ``elapsed_s[model, seed, trial]`` the recorded
    wall time of the trials so far (NaN where an entry has no durations). Trial counts are ``[model, seed]``."""

    best_so_far: np.ndarray
    space_sizes: tuple[int, ...]
    tolerance: float
    elapsed_s: np.ndarray

    def trials_to(self, levels: Sequence[float]) -> np.ndarray:
        """Trials each run took to reach ``levels[model]`` of its model's optimum (the space's size if never)."""
        return np.array([[_first_reaching(curve, level, size) for curve in runs]
                         for runs, level, size in zip(self.best_so_far, levels, self.space_sizes, strict=True)])

    def minutes_to_within(self) -> np.ndarray:
        """Minutes of recorded trial time each run took to within ``tolerance`` of its optimum (the whole run's if
        never; NaN where the entry recorded no durations), ``[model, seed]``."""
        counts = self.trials_to_within
        length = self.elapsed_s.shape[2]
        return np.array([[self.elapsed_s[m, s, min(count, length) - 1] / 60 for s, count in enumerate(runs)]
                         for m, runs in enumerate(counts)])

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
    durations = [entry.durations() for entry in entries]
    for name, factory in factories.items():
        shape = (len(entries), len(seeds))
        curves, elapsed = np.zeros((*shape, length)), np.zeros((*shape, length))
        for m, (entry, values) in enumerate(zip(entries, surfaces, strict=True)):
            prior = [other for i, other in enumerate(entries) if i != m]
            for s, seed in enumerate(seeds):
                searcher = factory(entry.space, seed, prior, target=entry.model.model_dump())
                curve, tried = _run(searcher, values, min(budget or entry.space.size, entry.space.size))
                seconds = np.cumsum(durations[m][tried])
                curves[m, s, : len(curve)], elapsed[m, s, : len(curve)] = curve, seconds
                curves[m, s, len(curve) :], elapsed[m, s, len(curve) :] = curve[-1], seconds[-1]
                if on_run is not None:
                    on_run(name, entry.name, seed)
        reports[name] = SearcherReport(curves, sizes, tolerance, elapsed)
    return ReplayResult(
        models=tuple(e.name for e in entries),
        space_sizes=sizes,
        seeds=tuple(seeds),
        tolerance=tolerance,
        searchers=reports,
    )


def _run(searcher: Searcher, values: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Best value so far / optimum after each trial, stopping once the optimum is observed, and the index of each
    configuration tried."""
    optimum = np.nanmax(values)
    history: list[Observation] = []
    curve, tried = [], []
    best = 0.0
    for _ in range(budget):
        config = searcher.suggest(history)
        index = searcher.space.index(config)
        value = values[index]
        history.append(Observation(config, None if np.isnan(value) else float(value)))
        best = max(best, 0.0 if np.isnan(value) else float(value))
        curve.append(best / optimum)
        tried.append(index)
        if best >= optimum:
            break
    return np.array(curve), np.array(tried)


def _first_reaching(curve: np.ndarray, level: float, cap: int) -> int:
    reached = np.flatnonzero(curve >= level)
    return int(reached[0]) + 1 if reached.size else cap
