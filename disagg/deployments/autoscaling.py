"""Autoscaling of the disaggregated DLRM's two pools, each on its own bottleneck: busy time.

Serve's default policy counts requests a deployment's replicas hold, which fits neither pool: a dense replica holds
its requests while it waits for lookups, so a slow embedding service would grow the dense pool; and dense replicas
call the shards over gRPC, not through Serve, so shard replicas never see a Serve request. Instead each replica
reports, as the custom autoscaling metric ``BUSY_METRIC``, the fraction of wall time it spent working (read through
``BusyFraction``): a dense replica in its dense stages, not waiting for lookups (``BusyMeter``); a shard replica with
a lookup in flight in its gRPC server (``EmbeddingServer.busy_seconds``). ``BusyTimePolicy`` sizes a pool so that
the work its replicas reported keeps each at ``target_utilization``: ``desired = sum(busy) / target_utilization``.
Serve wraps every custom policy with its own upscale/downscale delays and scaling factors, applies the
``min_replicas``/``max_replicas`` bounds and rounds the float up, as for its default policy.

Serve config (one entry per deployment, ``EmbeddingShard_<i>`` for every shard)::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      upscale_delay_s: 30
      downscale_delay_s: 600
      policy:
        policy_function: disagg.deployments.autoscaling:BusyTimePolicy
        policy_kwargs: {target_utilization: 0.6}

The arithmetic here imports no Ray; Serve (``AutoscalingContext``) is only read by ``BusyTimePolicy.__call__``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

#: Name of the custom autoscaling metric every replica of both pools reports (``record_autoscaling_stats``).
BUSY_METRIC = "busy"
#: Default share of wall time a replica should be busy; the rest absorbs bursts while Serve adds replicas.
DEFAULT_TARGET_UTILIZATION = 0.6

Clock = Callable[[], float]


class BusyMeter:
    """Busy seconds of one replica: wall time during which at least one ``with meter:`` section runs (overlapping
    sections count once, so the busy fraction stays within [0, 1]). Sections may run on any thread."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._running = 0
        self._busy = 0.0
        self._since = clock()

    def __enter__(self) -> None:
        with self._lock:
            self._advance()
            self._running += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        with self._lock:
            self._advance()
            self._running -= 1

    def busy_seconds(self) -> float:
        """Busy seconds since the meter was made, a section running now included up to now (non-decreasing)."""
        with self._lock:
            self._advance()
            return self._busy

    def _advance(self) -> None:  # lock held
        now = self._clock()
        if self._running:
            self._busy += now - self._since
        self._since = now


class BusyFraction:
    """``fraction()`` is the share of wall time busy since the previous call (the first call: since this object was
    made), from a non-decreasing counter of busy seconds such as ``BusyMeter.busy_seconds``, clipped to [0, 1]. Meant
    for one reader: Serve calls ``record_autoscaling_stats`` every ``min(look_back_period_s / 5, metrics_interval_s)``
    seconds and averages the fractions over ``look_back_period_s``."""

    def __init__(self, busy_seconds: Callable[[], float], clock: Clock = time.monotonic) -> None:
        self._busy_seconds = busy_seconds
        self._clock = clock
        self._last = (clock(), busy_seconds())

    def fraction(self) -> float:
        now, busy = self._clock(), self._busy_seconds()
        then, busy_then = self._last
        self._last = (now, busy)
        if now <= then:
            return 0.0
        return min(1.0, max(0.0, (busy - busy_then) / (now - then)))


def desired_replicas(busy: Iterable[float], target_utilization: float) -> float | None:
    """Replicas that would do the reported work busy ``target_utilization`` of the time each: ``sum(busy) /
    target_utilization``, a float (Serve rounds it up); None when no replica reported. ``busy`` holds each reporting
    replica's busy fraction over the look-back period: the work is the pool's whatever the count of replicas doing it,
    so a replica that has not reported yet (just started) adds nothing and changes nothing."""
    _check_target(target_utilization)
    values = list(busy)
    if not values:
        return None
    for value in values:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"busy fraction {value!r}: must be finite and >= 0")
    return sum(values) / target_utilization


def _check_target(target_utilization: float) -> None:
    if not (isinstance(target_utilization, int | float) and 0 < target_utilization <= 1):
        raise ValueError(f"target_utilization must be a number in (0, 1], got {target_utilization!r}")


class BusyTimePolicy:
    """Serve autoscaling policy of either pool: ``autoscaling_config.policy`` = ``{policy_function:
    "disagg.deployments.autoscaling:BusyTimePolicy", policy_kwargs: {target_utilization: 0.6}}``.

    Asks for ``desired_replicas`` of the ``BUSY_METRIC`` values Serve aggregated per running replica (time-weighted
    ``aggregation_function`` over ``look_back_period_s``), never fewer than one replica: shard replicas receive no
    Serve requests, so nothing would start one again from zero (``min_replicas: 0`` acts as 1). Before any replica
    reported, it keeps the current target. Serve applies the delays, scaling factors and replica bounds.
    """

    def __init__(self, target_utilization: float = DEFAULT_TARGET_UTILIZATION) -> None:
        _check_target(target_utilization)
        self.target_utilization = target_utilization

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get(BUSY_METRIC, {})
        desired = desired_replicas(per_replica.values(), self.target_utilization)
        if desired is None:
            return ctx.target_num_replicas, {}
        return max(1.0, desired), {}
