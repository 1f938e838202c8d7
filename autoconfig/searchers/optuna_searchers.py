"""Bayesian optimisation baselines over Optuna: TPE and Gaussian-process samplers.

Each knob is an ordinal parameter (the index of its value), so the samplers see the order of the values while
staying on the grid; a failed trial counts as 0. A suggestion already observed (or left out of the space) moves
to the nearest unobserved configuration in the space's encoding, deterministically.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import numpy as np
import optuna
from optuna.distributions import IntDistribution
from optuna.samplers import BaseSampler, GPSampler, TPESampler
from optuna.trial import TrialState, create_trial

from autoconfig.searchers.base import Observation, Searcher, objective_values
from autoconfig.space import Configuration, SearchSpace


class OptunaSearcher(Searcher):
    """Feeds the history to an Optuna study and maps its suggestion onto the unobserved grid."""

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        super().__init__(space)
        self.seed = seed
        self._distributions = {name: IntDistribution(0, len(space.values(name)) - 1) for name in space.knob_names}
        self._positions = {name: {v: i for i, v in enumerate(space.values(name))} for name in space.knob_names}
        self._study: optuna.Study | None = None
        self._told: list[Observation] = []

    @abstractmethod
    def _sampler(self) -> BaseSampler:
        """A fresh sampler seeded with ``self.seed``."""

    def _directions(self) -> list[str]:
        return ["maximize"]

    def _trial(self, observation: Observation, value: float) -> optuna.trial.FrozenTrial:
        """``observation`` as a finished Optuna trial (``value``: its objective, 0 when not met)."""
        return create_trial(params=self._params(observation.config), distributions=self._distributions,
                            value=float(value))

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        study = self._sync(history)
        trial = study.ask(self._distributions)
        study.tell(trial, state=TrialState.FAIL)  # only a proposal: the real outcome arrives in the next history
        point = np.array([self.space.coordinates(name)[trial.params[name]] for name in self.space.knob_names])
        return self.nearest_unobserved(point, observed)

    def _sync(self, history: Sequence[Observation]) -> optuna.Study:
        """The study holding exactly ``history``: extended in place when it only grew, else rebuilt."""
        if self._study is None or list(history[: len(self._told)]) != self._told:
            verbosity = optuna.logging.get_verbosity()
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            try:
                self._study = optuna.create_study(directions=self._directions(), sampler=self._sampler())
            finally:
                optuna.logging.set_verbosity(verbosity)
            self._told = []
        new = history[len(self._told) :]
        for observation, value in zip(new, objective_values(new), strict=True):
            self._study.add_trial(self._trial(observation, value))
        self._told.extend(new)
        return self._study


    def _params(self, config: Configuration) -> dict[str, int]:
        """``config`` as the study's parameters: the index of each knob's value."""
        return {name: self._positions[name][config[name]] for name in self._distributions}


class TPESearcher(OptunaSearcher):
    """Optuna's tree-structured Parzen estimator (10 random start-up trials, then TPE)."""

    def _sampler(self) -> BaseSampler:
        return TPESampler(seed=self.seed, constant_liar=False)


class GPSearcher(OptunaSearcher):
    """Optuna's Gaussian-process sampler (10 random start-up trials, then log expected improvement)."""

    def _sampler(self) -> BaseSampler:
        return GPSampler(seed=self.seed)


class ParetoSearcher(OptunaSearcher):
    """Optuna's multi-objective TPE over the objective (up) and the p99 latency at that rate (down), with the
    limits as its constraints (a trial's ``violation``; > 0 is over): it spreads trials along the front instead of
    climbing to one optimum. A trial with no latency (failed) is a failed Optuna trial."""

    def _directions(self) -> list[str]:
        return ["maximize", "minimize"]

    def _sampler(self) -> BaseSampler:
        return TPESampler(seed=self.seed)

    def _trial(self, observation: Observation, value: float) -> optuna.trial.FrozenTrial:
        p99 = observation.metrics.get("p99_ms")
        common = {"params": self._params(observation.config), "distributions": self._distributions}
        trial = create_trial(state=TrialState.FAIL, **common) if p99 is None else create_trial(
            values=[float(value), p99], **common)
        trial.set_constraint("limits", observation.metrics.get("violation", 0.0))
        return trial
