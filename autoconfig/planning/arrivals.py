"""A trace's services submitted one after another, in a seeded order, until the arrived workload reaches a share of
a cluster's capacity: the Monte-Carlo workload inflation of Weng et al. (ATC'23; their simulator's
``TunePodsByNodeTotalResource``: the trace's tasks in a seeded shuffle, then tasks drawn again from it, submitted
until the arrived GPU requests reach ``ratio`` times the cluster's GPUs), by whole services instead of single tasks.

- The pool: trace rows grouped by service (``app_name``), each service's rows in the order given.
- Units: a service with HN (GPU-node) instances arrives one HN instance at a time, each with its share of the
  service's CN (CPU-node) instances. Unit ``j`` of a service with ``h`` HN and ``c`` CN instances is, in the
  disaggregated layout, its ``j``-th HN instance followed by CN instances ``floor(j c / h)`` up to
  ``floor((j + 1) c / h) - 1``, and in the monolithic layout that HN instance fused with ``1/h`` of the service's CN
  CPUs and memory (``services.FUSION_RULE``, over the whole service). Both layouts have arrived the same CPUs, memory
  and GPUs once a service has arrived whole, and within one CN instance of each other before. A service with no HN
  instance arrives one CN instance at a time, the same in both layouts.
- Order: the pool's services in a seeded random order (``numpy.random.default_rng(seed).permutation``), each whole
  before the next; once every service has arrived, the services again in a new seeded order, as copies
  (``<name>~<copy>``, their ``max_instance_per_node`` counted per copy), and so on.
- Arrived: the CPUs, memory and GPUs requested by the units submitted so far, placed or not (as the simulator counts
  its arrived GPU requests before a task is scheduled), as a share of the cluster's capacity: of one resource, or
  ``dominant``, the largest of the three shares.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from autoconfig.planning.services import Instance, TraceRow, _instance, fuse

Axis = Literal["dominant", "cpus", "memory_gib", "gpus"]
AXES: tuple[Axis, ...] = ("dominant", "cpus", "memory_gib", "gpus")
RESOURCES = ("cpus", "memory_gib", "gpus")
#: Passes over the pool at most before ``arrivals`` gives up (a share the pool cannot reach in reasonable time).
MOST_PASSES = 64


@dataclass(frozen=True)
class Unit:
    """One arrival: its instances in each layout."""

    service: str
    monolithic: tuple[Instance, ...]
    disaggregated: tuple[Instance, ...]


def units(rows: Sequence[TraceRow]) -> dict[str, list[Unit]]:
    """Every service's units (module docstring), services in the order they first appear in ``rows``."""
    hn: dict[str, list[TraceRow]] = defaultdict(list)
    cn: dict[str, list[TraceRow]] = defaultdict(list)
    order: dict[str, None] = {}
    for row in rows:
        order.setdefault(row.app, None)
        (hn if row.role == "HN" else cn)[row.app].append(row)
    fused = {instance.name: instance for instance in fuse(rows)}
    result: dict[str, list[Unit]] = {}
    for app in order:
        gpu_side, cpu_side = hn[app], cn[app]
        if not gpu_side:
            result[app] = [Unit(app, (fused[row.name],), (fused[row.name],)) for row in cpu_side]
            continue
        h, c = len(gpu_side), len(cpu_side)
        result[app] = [Unit(app, (fused[row.name],),
                            (_instance(row, "HN"), *(_instance(cpu_side[k], "CN") for k in range(j * c // h,
                                                                                                  (j + 1) * c // h))))
                       for j, row in enumerate(gpu_side)]
    return result


def _copy(unit: Unit, copy: int) -> Unit:
    if copy == 0:
        return unit

    def renamed(instance: Instance) -> Instance:
        return replace(instance, name=f"{instance.name}~{copy}", service=f"{instance.service}~{copy}",
                       group=f"{instance.group}~{copy}")

    return Unit(f"{unit.service}~{copy}", tuple(map(renamed, unit.monolithic)), tuple(map(renamed, unit.disaggregated)))


def _demand(instances: Sequence[Instance]) -> np.ndarray:
    return np.array([sum(i.cpus for i in instances), sum(i.memory_gib for i in instances),
                     sum(i.gpus for i in instances)], float)


@dataclass(frozen=True)
class Arrivals:
    """Units in the order they arrive, and after each the instances and demand arrived so far."""

    seed: int
    units: tuple[Unit, ...]
    services: tuple[str, ...]  # in the order they arrived (copies named <app>~<copy>)
    arrived: np.ndarray  # (units, 3): CPUs, memory (GiB) and GPUs arrived after each unit, as fused (exact shares)

    def instances(self, layout: str, count: int | None = None) -> list[Instance]:
        """The first ``count`` units' instances in ``layout`` (every unit's by default), in arrival order."""
        chosen = self.units if count is None else self.units[:count]
        return [instance for unit in chosen for instance in getattr(unit, layout)]

    def ends(self, layout: str) -> np.ndarray:
        """(units,): how many instances of ``layout`` have arrived after each unit."""
        return np.cumsum([len(getattr(unit, layout)) for unit in self.units])

    def shares(self, capacity: dict[str, float], axis: Axis = "dominant") -> np.ndarray:
        """(units,): the arrived share of ``capacity`` after each unit, on ``axis``."""
        return share(self.arrived, capacity, axis)

    def reached(self, capacity: dict[str, float], targets: Sequence[float], axis: Axis = "dominant") -> list[int]:
        """For each target share, the number of units after which the arrived share first reaches it."""
        shares = self.shares(capacity, axis)
        found = np.searchsorted(shares, np.asarray(targets, float) - 1e-9, side="left")
        if (found >= len(shares)).any():
            raise ValueError(f"the arrivals reach {shares[-1] if len(shares) else 0:.3f} of the capacity on {axis}, "
                             f"short of {max(targets):g}")
        return [int(index) + 1 for index in found]


def share(arrived: np.ndarray, capacity: dict[str, float], axis: Axis = "dominant") -> np.ndarray:
    """Arrived CPUs, memory and GPUs (rows of ``arrived``) as a share of ``capacity`` on ``axis``."""
    if axis not in AXES:
        raise ValueError(f"axis {axis!r}: one of {', '.join(AXES)}")
    scale = np.array([capacity[r] for r in RESOURCES], float)
    with np.errstate(divide="ignore", invalid="ignore"):
        shares = np.where(scale > 0, np.asarray(arrived, float).reshape(-1, 3) / np.where(scale > 0, scale, 1), 0.0)
    return shares.max(axis=1) if axis == "dominant" else shares[:, RESOURCES.index(axis)]


def arrivals(rows: Sequence[TraceRow], seed: int, capacity: dict[str, float], until: float,
             axis: Axis = "dominant") -> Arrivals:
    """The pool's services in ``seed``'s order (module docstring), unit by unit, up to and including the unit at
    which the arrived share of ``capacity`` on ``axis`` first reaches ``until``."""
    pool = units(rows)
    if not pool:
        raise ValueError("no trace rows to draw services from")
    total = share(_demand([i for service in pool.values() for u in service for i in u.monolithic]), capacity, axis)
    if total[0] <= 0:
        raise ValueError(f"the trace requests nothing the cluster has on {axis}")
    names = list(pool)
    rng = np.random.default_rng(seed)
    chosen: list[Unit] = []
    services: list[str] = []
    arrived: list[np.ndarray] = []
    sums = np.zeros(3)
    for copy in range(MOST_PASSES):
        for index in rng.permutation(len(names)):
            services.append(names[index] if copy == 0 else f"{names[index]}~{copy}")
            for unit in pool[names[index]]:
                unit = _copy(unit, copy)
                sums = sums + _demand(unit.monolithic)
                chosen.append(unit)
                arrived.append(sums.copy())
                if share(sums, capacity, axis)[0] >= until - 1e-9:
                    return Arrivals(seed, tuple(chosen), tuple(services), np.array(arrived))
    raise ValueError(f"{MOST_PASSES} passes over the trace's services reach {share(sums, capacity, axis)[0]:.3f} of "
                     f"the capacity on {axis}, short of {until:g}")
