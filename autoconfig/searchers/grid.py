"""Grid search: every configuration, in the space's enumeration order or in deployment order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from autoconfig.searchers.base import Observation, Searcher
from autoconfig.space import SearchSpace

GridOrder = Literal["enumeration", "deployment"]

#: Knobs from the one whose change costs the most when a deployed trial app is updated in place (new replica
#: processes for every replica) to the cheapest (a live ``reconfigure``).
DEPLOYMENT_ORDER = ("device_share", "torch_threads", "num_replicas", "max_batch_size", "batch_wait_timeout_s")


class GridSearcher(Searcher):
    """The first unobserved configuration in ``order``.

    ``deployment`` order sorts by :data:`DEPLOYMENT_ORDER`, so a grid profiled on one trial app kept deployed
    restarts replicas only when the device share or the threads change (a few times per grid).
    """

    def __init__(self, space: SearchSpace, order: GridOrder = "enumeration") -> None:
        super().__init__(space)
        configurations = space.configurations()
        if order == "deployment":
            def key(index: int) -> tuple[float, ...]:
                config = configurations[index]
                return tuple(getattr(config, name) or 0 for name in DEPLOYMENT_ORDER)

            self._order = np.array(sorted(range(space.size), key=key), dtype=np.int64)
        else:
            self._order = np.arange(space.size)

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        return int(self._order[np.argmin(observed[self._order])])
