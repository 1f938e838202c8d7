"""Grid search: every configuration, in the space's enumeration order or in deployment order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from autoconfig.searchers.base import Observation, Searcher
from autoconfig.space import SearchSpace

GridOrder = Literal["enumeration", "deployment"]

#: Options a deployed trial app changes live, without new replica processes (cheapest last).
_REPLICA_COUNTS = ("num_replicas",)
_LIVE = ("max_batch_size", "batch_wait_timeout_s", "user_config", "max_ongoing_requests", "max_queued_requests",
         "autoscaling_config")


def change_cost(knob: str) -> int:
    """How much changing ``knob`` costs a trial app updated in place: 0 new processes for every replica
    (``device_share``, ``torch_threads``, resources, ``runtime_env``...), 1 replicas added or removed, 2 a live
    ``reconfigure`` or option."""
    option = knob.split(".")[1] if "." in knob else knob
    if option in _REPLICA_COUNTS:
        return 1
    return 2 if option in _LIVE else 0


class GridSearcher(Searcher):
    """The first unobserved configuration in ``order``.

    ``deployment`` order sorts by the knobs' values, the costliest to change (:func:`change_cost`) first, so a
    grid profiled on one trial app kept deployed restarts replicas only when the device share, the threads or
    another resource changes (a few times per grid).
    """

    def __init__(self, space: SearchSpace, order: GridOrder = "enumeration") -> None:
        super().__init__(space)
        configurations = space.configurations()
        if order == "deployment":
            knobs = sorted(space.knob_names, key=change_cost)  # stable: the space's order within a cost
            positions = {name: {value: i for i, value in enumerate(space.values(name))} for name in knobs}

            def key(index: int) -> tuple[int, ...]:
                config = configurations[index]
                return tuple(positions[name][config[name]] for name in knobs)

            self._order = np.array(sorted(range(space.size), key=key), dtype=np.int64)
        else:
            self._order = np.arange(space.size)

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        return int(self._order[np.argmin(observed[self._order])])
