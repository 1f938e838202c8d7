"""How alike two profiled models are before any trial: their descriptions (app, builder arguments, workload, SLO).

A searcher that learns from a bank may weight each other model by this likeness until the trials say more. The
distance walks both descriptions together: a number against a number costs the decades between them (rows per
request 16 against 160: 1; an SLO of 40 ms against 100 ms: 0.4), any other mismatch costs 1, a key or subtree on
one side only costs 1 (a layout's extra arguments count once), and ``name`` is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: A description's distance at which another model's weight falls to 1/e of an identical one's.
LIKENESS_SCALE = 1.0


def description_distance(a: Any, b: Any) -> float:
    """Mismatch between two model descriptions (nested mappings), 0 for identical ones."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return sum(description_distance(a.get(key), b.get(key)) for key in a.keys() | b.keys() if key != "name")
    if _is_number(a) and _is_number(b):
        if a > 0 and b > 0:
            return abs(math.log10(a) - math.log10(b))
        return float(a != b)
    return float(a != b)


def context_weights(target: Mapping[str, Any], others: Sequence[Mapping[str, Any]],
                    scale: float = LIKENESS_SCALE) -> np.ndarray:
    """A weight per other model's description, summing to 1: ``exp(-distance / scale)``, normalised."""
    if not others:
        raise ValueError("context weights need at least one other model")
    distances = np.array([description_distance(target, other) for other in others])
    weights = np.exp(-(distances - distances.min()) / scale)  # shifted: the nearest weighs 1 before normalising
    return weights / weights.sum()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
