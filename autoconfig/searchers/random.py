"""Random search: unobserved configurations uniformly at random."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autoconfig.searchers.base import Observation, Searcher
from autoconfig.space import SearchSpace


class RandomSearcher(Searcher):
    """A seeded random permutation of the space; the same seed gives the same order."""

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        super().__init__(space)
        self.order = np.random.default_rng(seed).permutation(space.size)

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        return int(self.order[np.argmin(observed[self.order])])
