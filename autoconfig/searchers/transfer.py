"""Baselines that learn from other models' profiles without a surrogate: what the meta searcher must beat.

``BestOnAverageSearcher`` profiles configurations in the order of their mean normalised objective over the prior
profiles and never looks at the trials; ``WarmTPESearcher`` first profiles each prior model's best configuration
(Optuna ``enqueue_trial``), then runs TPE on the trials.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import optuna
from optuna.samplers import BaseSampler, TPESampler

from autoconfig.bank import BankEntry
from autoconfig.searchers.base import Observation, Searcher, comparable
from autoconfig.searchers.optuna_searchers import OptunaSearcher
from autoconfig.space import Configuration, SearchSpace


def prior_surfaces(space: SearchSpace, entries: Sequence[BankEntry]) -> np.ndarray:
    """One row per entry (:func:`comparable` ones): its measured objective at each configuration of ``space``
    divided by the entry's best (0 where it held no rate; NaN where the entry did not profile that configuration)."""
    rows = []
    for entry in entries:
        measured = entry.measured()
        best = max(measured.values(), default=0.0)
        rows.append([np.nan if c not in measured else (measured[c] / best if best > 0 else 0.0)
                     for c in space.configurations()])
    return np.array(rows, dtype=np.float64)


class BestOnAverageSearcher(Searcher):
    """Configurations by descending mean normalised objective over the prior profiles (configurations none of
    them profiled last, in grid order); the trials so far change nothing."""

    def __init__(self, space: SearchSpace, prior: Sequence[BankEntry]) -> None:
        super().__init__(space)
        surfaces = prior_surfaces(space, comparable(space, prior))
        profiled = ~np.isnan(surfaces).all(axis=0)
        mean = np.where(profiled, np.nan_to_num(surfaces, nan=0.0).mean(axis=0), -np.inf)
        self.order = np.argsort(-mean, kind="stable")

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        return int(next(index for index in self.order if not observed[index]))


class WarmTPESearcher(OptunaSearcher):
    """TPE whose first trials are the prior models' best configurations (each model's best, those better on
    average first), enqueued into the Optuna study; then TPE over every trial."""

    def __init__(self, space: SearchSpace, seed: int, prior: Sequence[BankEntry]) -> None:
        super().__init__(space, seed)
        surfaces = np.nan_to_num(prior_surfaces(space, comparable(space, prior)), nan=0.0)
        mean = surfaces.mean(axis=0)
        bests = dict.fromkeys(int(np.argmax(row)) for row in surfaces if row.max() > 0)
        configurations = space.configurations()
        self.warm_start: list[Configuration] = [configurations[i] for i in sorted(bests, key=lambda i: -mean[i])]

    def _sampler(self) -> BaseSampler:
        return TPESampler(seed=self.seed, constant_liar=False)

    def _sync(self, history: Sequence[Observation]) -> optuna.Study:
        study = super()._sync(history)
        if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            tried = {observation.config for observation in history}
            for config in (config for config in self.warm_start if config not in tried):
                study.enqueue_trial(self._params(config))
                break  # one at a time: the next is enqueued once this one's outcome is in the history
        return study
