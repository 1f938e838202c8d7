"""Grid search: every configuration in the space's enumeration order."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autoconfig.searchers.base import Observation, Searcher


class GridSearcher(Searcher):
    """The first unobserved configuration in enumeration order."""

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        return int(np.argmin(observed))
