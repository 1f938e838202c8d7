"""How reproducible a measured optimum is: the floor under any searcher's trials to it on a noisy machine.

Four measures. From one entry's repeats: how often two runs name the same configuration best among those measured
again; and, simulating profiles of the model with the noise those repeats show, the trials to each simulated
profile's optimum in the order of the entry's own surface, the floor under a searcher that knew the model's surface
exactly. From two independent profiles of one model: the trials a searcher takes to the second profile's
optimum when it profiles configurations in the order the first measured them, a prior that no other model's
profile can better. Over a bank: the trials each model takes in the one fixed order that is best in hindsight (its
configurations by how many of the bank's optima they are), the floor under any ranking that ignores the trials
(docs/AUTOCONFIG.md, "When the optimum moves between runs").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import combinations

import numpy as np
from scipy.stats import spearmanr

from autoconfig.bank import BankEntry, BankError


def best_agreement(entry: BankEntry) -> tuple[float, float] | None:
    """The share of pairs of repeat runs that name the same repeated configuration best (a run that held no rate
    counts 0; ties go to the first repeated), and the share chance gives (1 over the configurations). The first
    run, the profile's own trial, picked these configurations for being best, so only the runs after it are
    paired, by position, up to the fewest any configuration has; None without two repeated configurations and
    two such runs."""
    runs = min((len(repeat.objectives) for repeat in entry.repeats), default=0)
    if len(entry.repeats) < 2 or runs < 3:
        return None
    values = np.array([[value or 0.0 for value in repeat.objectives[1:runs]] for repeat in entry.repeats])
    best = values.argmax(axis=0)
    agreements = [best[a] == best[b] for a, b in combinations(range(runs - 1), 2)]
    return float(np.mean(agreements)), 1.0 / len(entry.repeats)


def configuration_noise(entry: BankEntry) -> np.ndarray | None:
    """Each configuration's relative measurement noise (std / mean of its objective), in enumeration order: the
    entry's :meth:`~BankEntry.noise`, over the square root of the runs for a repeated configuration (its objective is
    their mean); None without repeats to estimate it from."""
    if (noise := entry.noise()) is None:
        return None
    runs = np.ones(entry.space.size)
    for repeat in entry.repeats:
        runs[entry.space.index(repeat.config)] = len(repeat.objectives)
    return noise / np.sqrt(runs)


def noise_floor_trials(entry: BankEntry, *, draws: int = 2000, seed: int = 0) -> np.ndarray | None:
    """Trials to the optimum of ``draws`` simulated profiles of the entry's model, in the order of its own surface.

    A simulated profile scales each configuration's objective by a lognormal factor of mean 1 and the relative spread
    of :func:`configuration_noise` (no rate stays no rate). A searcher that knew the surface exactly ranks by it, so
    these counts are the floor under searchers judged against one noisy profile. None without repeats."""
    if (noise := configuration_noise(entry)) is None:
        return None
    values = np.nan_to_num(entry.surface()[1], nan=0.0)
    spread = np.sqrt(np.log1p(noise**2))  # the lognormal's sigma whose std / mean is ``noise``
    factors = np.exp(spread * np.random.default_rng(seed).standard_normal((draws, values.size)) - spread**2 / 2)
    optima = (values * factors).argmax(axis=1)
    order = _profiling_order(values)
    position = np.empty(values.size, dtype=int)
    position[order] = np.arange(1, values.size + 1)
    return position[optima]


def trials_in_order(order_values: np.ndarray, target_values: np.ndarray) -> int:
    """Trials until ``target_values``' optimum is profiled when configurations go by descending ``order_values``
    (NaN, no rate, last; ties by enumeration); both are surfaces over the same configurations."""
    if order_values.shape != target_values.shape:
        raise ValueError(f"surfaces of {order_values.shape} and {target_values.shape} configurations")
    target = np.nan_to_num(target_values, nan=0.0)
    if not target.max() > 0:
        raise ValueError("the target surface has no configuration with a positive objective")
    order = _profiling_order(order_values)
    return int(np.flatnonzero(target[order] >= target.max())[0]) + 1


def _profiling_order(values: np.ndarray) -> np.ndarray:
    """Configuration indices by descending value, NaN (no rate) as 0, ties in enumeration order."""
    return np.argsort(-np.nan_to_num(values, nan=0.0), kind="stable")


def same_model_trials(first: BankEntry, second: BankEntry) -> int:
    """Trials to ``second``'s optimum in the order of ``first``'s surface (two profiles of one model)."""
    _check_pair(first, second)
    return trials_in_order(first.surface()[1], second.surface()[1])


def surface_rank_correlation(first: BankEntry, second: BankEntry) -> float:
    """Spearman's rank correlation of two profiles' surfaces (no rate counting 0)."""
    _check_pair(first, second)
    a, b = (np.nan_to_num(entry.surface()[1], nan=0.0) for entry in (first, second))
    return float(spearmanr(a, b).statistic)


def hindsight_order_trials(entries: Sequence[BankEntry]) -> list[int]:
    """Per entry, the trials to its optimum when configurations go by how many of the entries' optima they are
    (most first): no fixed order, even one that knows every optimum, has a smaller k-th smallest count."""
    optima = [optimum_index(entry) for entry in entries]
    if len({entry.space.configurations() for entry in entries}) > 1:
        raise BankError("a fixed order needs the entries over one search space")
    counts = Counter(optima)
    order = sorted(counts, key=lambda index: (-counts[index], index))
    return [order.index(optimum) + 1 for optimum in optima]


def optimum_index(entry: BankEntry) -> int:
    """The index (in enumeration order) of the entry's best configuration on its surface."""
    return int(np.nanargmax(entry.surface()[1]))


def _check_pair(first: BankEntry, second: BankEntry) -> None:
    if first.name != second.name:
        raise BankError(f"profiles of two models ({first.name}, {second.name}), not two of one model")
    if first.space.configurations() != second.space.configurations():
        raise BankError(f"{first.name}: the two profiles are over different search spaces")
