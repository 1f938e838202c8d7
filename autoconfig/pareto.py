"""Limits and Pareto fronts: the trade-off between the rate per device share, the p99 latency and the memory of
what a study measured, under the limits a user sets.

``Limits`` turn a measured trial into a violation (> 0: over a limit; Optuna's constraint convention);
``pareto_front`` picks the ok, within-limit trials no other beats on every metric (docs/AUTOCONFIG.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: The front's metrics and which way is better: the objective up, the latency and the memory down.
FRONT_METRICS: tuple[tuple[str, int], ...] = (("objective", 1), ("p99_ms", -1), ("memory_mib", -1))


class Limits(BaseModel):
    """Limits a configuration must keep once measured (``None``: no limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_memory_mib: float | None = Field(None, gt=0.0, description="Most resident memory of the app's replicas.")

    def violation(self, measurements: Mapping[str, Any]) -> tuple[float, str | None]:
        """How far ``measurements`` (a trial record) are over the limits, relative (0: within them), and why."""
        memory = measurements.get("memory_mib")
        if self.max_memory_mib is None:
            return 0.0, None
        if memory is None:  # not measured (a failed trial, or replicas on other nodes): cannot be shown within
            return 1.0, "memory not measured"
        over = memory / self.max_memory_mib - 1.0
        if over <= 0:
            return 0.0, None
        return over, f"memory {memory:.0f} MiB over the limit of {self.max_memory_mib:g} MiB"


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether point ``a`` is at least as good as ``b`` everywhere and better somewhere (larger is better)."""
    return all(x >= y for x, y in zip(a, b, strict=True)) and any(x > y for x, y in zip(a, b, strict=True))


def front_metrics(records: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The metrics every ok record has: the objective and p99, and memory where every one measured it."""
    ok = [record for record in records if record.get("status") == "ok"]
    return tuple(name for name, _ in FRONT_METRICS if ok and all(record.get(name) is not None for record in ok))


def pareto_front(records: Sequence[Mapping[str, Any]], limits: Limits | None = None) -> list[int]:
    """Indices of the ok records within the limits (``limits``, and those a study applied: a stored ``violation``
    above 0 is out) that no other such record dominates on :func:`front_metrics`, by descending objective (equal
    points all kept)."""
    limits = limits or Limits()
    metrics = front_metrics(records)
    sign = dict(FRONT_METRICS)
    candidates = [i for i, record in enumerate(records) if record.get("status") == "ok"
                  and not record.get("violation") and limits.violation(record)[0] == 0.0]
    points = {i: tuple(sign[name] * float(records[i][name]) for name in metrics) for i in candidates}
    front = [i for i in candidates if not any(dominates(points[j], points[i]) for j in candidates if j != i)]
    return sorted(front, key=lambda i: -float(records[i]["objective"]))
