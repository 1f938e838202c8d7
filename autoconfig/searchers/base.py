"""The searcher interface: given the trials so far, suggest the next configuration to profile."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from autoconfig.space import Configuration, SearchSpace

if TYPE_CHECKING:
    from autoconfig.bank import BankEntry


@dataclass(frozen=True)
class Observation:
    """A profiled configuration; ``value`` is None when the trial failed, no rate met the SLO or it broke a limit.
    ``metrics`` holds what else was measured (``p99_ms``, ``memory_mib``; the limit ``violation``, 0 within)."""

    config: Configuration
    value: float | None
    metrics: Mapping[str, float] = field(default_factory=dict, compare=False)


class SpaceExhausted(Exception):
    """Every configuration of the space has been observed."""


class Searcher(ABC):
    """Suggests unobserved configurations of one space; the objective is maximised."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space

    def suggest(self, history: Sequence[Observation]) -> Configuration:
        """The next configuration to profile, never one in ``history``.

        Raises :class:`SpaceExhausted` when every configuration has been observed.
        """
        observed = np.zeros(self.space.size, dtype=bool)
        observed[[self.space.index(o.config) for o in history]] = True
        if observed.all():
            raise SpaceExhausted(f"all {self.space.size} configurations have been observed")
        index = self._suggest(history, observed)
        if observed[index]:
            raise RuntimeError(f"{type(self).__name__} suggested observed configuration #{index}")
        return self.space.configurations()[index]

    @abstractmethod
    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        """Index (in enumeration order) of an unobserved configuration; ``observed`` is a boolean mask."""

    def nearest_unobserved(self, point: np.ndarray, observed: np.ndarray) -> int:
        """The unobserved configuration closest to ``point`` in the encoding; ties go to the lowest index."""
        distances = np.linalg.norm(self.space.encode_all() - point, axis=1)
        distances[observed] = np.inf
        return int(np.argmin(distances))


class SearcherFactory(Protocol):
    """Builds a searcher for ``space``; ``prior`` are profiles of other models (used by the searchers that learn
    from a bank), ``target`` the description of the model to tune, as a bank entry's ``model`` (when known)."""

    def __call__(self, space: SearchSpace, seed: int, prior: Sequence[BankEntry],
                 target: Mapping[str, Any] | None = None) -> Searcher: ...


def objective_values(history: Sequence[Observation]) -> np.ndarray:
    """The history's values as an array, a failed trial counting as 0 (no sustainable rate)."""
    return np.array([0.0 if o.value is None else o.value for o in history], dtype=np.float64)


def comparable(space: SearchSpace, prior: Sequence[BankEntry]) -> list[BankEntry]:
    """The prior entries profiled over the knobs of ``space`` (a searcher learns only from those); a ValueError if
    there is none."""
    entries = [entry for entry in prior if entry.space.knob_names == space.knob_names]
    if not entries:
        raise ValueError(f"no profile in the bank is over the knobs {', '.join(space.knob_names)}")
    return entries
