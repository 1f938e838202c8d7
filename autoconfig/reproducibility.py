"""How reproducible a measured optimum is: the floor under any searcher's trials to it on a noisy machine.

Three measures. From one entry's repeats: how often two runs name the same configuration best among those measured
again. From two independent profiles of one model: the trials a searcher takes to the second profile's
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


def trials_in_order(order_values: np.ndarray, target_values: np.ndarray) -> int:
    """Trials until ``target_values``' optimum is profiled when configurations go by descending ``order_values``
    (NaN, no rate, last; ties by enumeration); both are surfaces over the same configurations."""
    if order_values.shape != target_values.shape:
        raise ValueError(f"surfaces of {order_values.shape} and {target_values.shape} configurations")
    target = np.nan_to_num(target_values, nan=0.0)
    if not target.max() > 0:
        raise ValueError("the target surface has no configuration with a positive objective")
    order = np.argsort(-np.nan_to_num(order_values, nan=0.0), kind="stable")
    return int(np.flatnonzero(target[order] >= target.max())[0]) + 1


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
