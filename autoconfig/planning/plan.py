"""A plan: a workload placed on a cluster with a policy, and what it leaves stranded, as a JSON-ready dict.

``make_plan`` places; ``summary`` is what people read (replicas per pool and their nodes, what could not be placed
and why, fragmentation); ``details`` adds every instance's node. ``smallest`` with ``places_all`` finds the smallest
cluster of a family (a prefix of a node list, a count of homogeneous nodes) on which a policy places every instance
that fits some node of it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoconfig.planning.cluster import Cluster
from autoconfig.planning.fragmentation import DEFINITIONS, NodeState, Shapes, report
from autoconfig.planning.placement import Placement, Policy, Progress, place
from autoconfig.planning.services import Workload


@dataclass
class Plan:
    workload: Workload
    placement: Placement
    fragmentation: dict[str, dict[str, float]]

    @property
    def cluster(self) -> Cluster:
        return self.placement.cluster


def make_plan(workload: Workload, cluster: Cluster, policy: Policy, *, progress: Progress | None = None) -> Plan:
    placement = place(workload.instances, cluster, policy, progress=progress)
    return Plan(workload, placement, report(placement.state, cluster, placement.shapes))


def unplaceable(workload: Workload, cluster: Cluster) -> list[int]:
    """Indices of the instances that fit no node of ``cluster`` even when it is empty."""
    empty = NodeState.empty(cluster)
    fit: dict[tuple[float, float, float], bool] = {}
    for instance in workload.instances:
        if instance.shape not in fit:
            fit[instance.shape] = bool(empty.fits([instance.cpus], [instance.memory_gib], [instance.gpus]).any())
    return [i for i, instance in enumerate(workload.instances) if not fit[instance.shape]]


def pools(plan: Plan) -> list[dict[str, Any]]:
    """Per (service, pool): replicas wanted and placed, and how many landed on each node."""
    wanted: Counter[tuple[str, str]] = Counter()
    on_nodes: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for instance, node in zip(plan.workload.instances, plan.placement.nodes, strict=True):
        key = (instance.service, instance.pool)
        wanted[key] += 1
        if node >= 0:
            on_nodes[key][plan.cluster.names[node]] += 1
    return [{"service": service, "pool": pool, "replicas": count, "placed": sum(on_nodes[(service, pool)].values()),
             "nodes": dict(on_nodes[(service, pool)])} for (service, pool), count in wanted.items()]


def summary(plan: Plan, *, with_pools: bool = True) -> dict[str, Any]:
    """What a plan decided and what it strands (``fragmentation``: per resource, ``DEFINITIONS``)."""
    placement, workload = plan.placement, plan.workload
    unplaced = placement.unplaced
    result: dict[str, Any] = {
        "layout": workload.layout, "policy": placement.policy,
        "cluster": {"nodes": len(plan.cluster), **plan.cluster.totals()},
        "workload": {"instances": len(workload.instances), "demand": workload.demand(), **workload.notes},
        "placed": len(workload.instances) - len(unplaced), "unplaced": len(unplaced),
        "unplaced_fits_no_node": sum(placement.reasons[i].startswith("fits no node") for i in unplaced),
        "nodes_used": placement.nodes_used(),
        "fragmentation": plan.fragmentation,
        "definitions": DEFINITIONS,
    }
    if with_pools:
        result["pools"] = pools(plan)
    return result


def details(plan: Plan) -> dict[str, Any]:
    """The summary plus every instance's node and every unplaced instance with its reason."""
    names = plan.cluster.names
    instances = plan.workload.instances
    return {**summary(plan),
            "assignments": [{"instance": instance.name, "service": instance.service, "pool": instance.pool,
                             "node": names[node]}
                            for instance, node in zip(instances, plan.placement.nodes, strict=True) if node >= 0],
            "unplaced_instances": [{"instance": instances[i].name, "service": instances[i].service,
                                    "pool": instances[i].pool, "cpus": instances[i].cpus,
                                    "memory_gib": instances[i].memory_gib, "gpus": instances[i].gpus,
                                    "reason": plan.placement.reasons[i]} for i in plan.placement.unplaced]}


def places_all(workload: Workload, cluster: Cluster, policy: Policy, *, skip: frozenset[int] = frozenset(),
               shapes: Shapes | None = None) -> bool:
    """Whether ``policy`` places on ``cluster`` every instance but those in ``skip`` (the instances that fit no
    node of the family of clusters searched: ``unplaceable`` of its largest); ``shapes``: the target workload the
    policy steers by (default: the instances' own shapes)."""
    return set(place(workload.instances, cluster, policy, shapes=shapes).unplaced) <= skip


def smallest(feasible: Callable[[int], bool], low: int, high: int) -> int | None:
    """The smallest ``n`` in ``[low, high]`` with ``feasible(n)``, by bisection (assumes that a larger cluster
    never places less); None when even ``high`` is not feasible."""
    if not feasible(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if feasible(middle):
            high = middle
        else:
            low = middle + 1
    return high
