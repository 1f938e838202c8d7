"""What a placement strands: free resources the workload cannot use.

Fragmentation follows Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation
Gradient Descent" (USENIX ATC'23; the measure of their Kubernetes scheduler simulator, ``pkg/utils/frag.go`` in
hkust-adsl/kubernetes-scheduler-simulator), applied to each resource:

- the target workload ``M`` is the instance shapes (CPUs, memory, GPUs) of the workload being placed, each with its
  popularity ``p_m`` (its share of the instances), left out the shapes that fit no node of the cluster even when
  empty (those are reported as unplaceable, not as fragmentation);
- for a resource ``r`` only the shapes that request it count (``M_r``, popularities renormalised): GPU
  fragmentation is measured against the GPU instances (the simulator's typical pods without CPU-only pods);
- ``F_n(m)``, the amount of node ``n``'s free ``r`` that instance shape ``m`` cannot use: all of it when ``m`` does not
  fit ``n`` (short of CPUs, memory or GPUs: quadrants I, II and IV of the paper); when ``m`` fits, nothing, except
  for GPUs: the free shares of the GPUs with less free than ``min(gpus_m, 1)`` (partially used GPUs too small for it);
- ``F_n(M) = sum_m p_m F_n(m)``, and the cluster's fragmentation ``F(M) = sum_n F_n(M)``, reported as an amount and as
  a fraction of the cluster's capacity of ``r``.

Beside it, ``stranded``: free ``r`` on nodes where no shape of ``M_r`` fits at all (Prism's "unallocated GPUs
stranded" when a node's CPUs or memory are exhausted; Borg's stranded resources). ``max_per_node`` limits are not
part of either measure (they belong to services, not to shapes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoconfig.planning.cluster import Cluster
from autoconfig.planning.services import Instance

EPS = 1e-6
RESOURCES = ("gpus", "cpus", "memory_gib")
#: The definitions as plan results state them.
DEFINITIONS = {
    "fragmented": "ATC'23 fragmentation F(M) = sum over nodes n and shapes m of p_m F_n(m) (Weng et al., 'Beware of "
                  "Fragmentation', USENIX ATC'23, and its simulator's pkg/utils/frag.go), per resource r: M_r = the "
                  "workload's instance shapes that request r and fit some empty node, p_m their share of its "
                  "instances; F_n(m) = n's free r when m does not fit n (short of CPUs, memory or GPUs), else 0, "
                  "except GPUs: the free shares of n's GPUs with less free than min(gpus_m, 1)",
    "stranded": "free r on nodes where no shape of M_r fits (Prism, NSDI'25: GPUs stranded when a node's CPUs or "
                "memory are exhausted)",
    "fraction": "amounts over the cluster's capacity of r",
}


@dataclass(frozen=True)
class Shapes:
    """Distinct instance shapes and their popularity (share of the instances counted)."""

    cpus: np.ndarray
    memory_gib: np.ndarray
    gpus: np.ndarray
    popularity: np.ndarray

    def __len__(self) -> int:
        return len(self.cpus)

    def requesting(self, resource: str) -> np.ndarray:
        """Popularities renormalised over the shapes that request ``resource`` (zero elsewhere)."""
        weights = np.where(getattr(self, resource) > 0, self.popularity, 0.0)
        total = weights.sum()
        return weights / total if total > 0 else weights


@dataclass
class NodeState:
    """Free resources of each node: ``cpus``, ``memory_gib`` (N,) and each GPU's free share ``gpus`` (N, G), zero
    for GPUs a node does not have."""

    cpus: np.ndarray
    memory_gib: np.ndarray
    gpus: np.ndarray

    @classmethod
    def empty(cls, cluster: Cluster) -> NodeState:
        width = max(1, int(cluster.gpus.max(initial=0)))
        gpus = (np.arange(width)[None, :] < cluster.gpus[:, None]).astype(float)
        return cls(cluster.cpus.astype(float).copy(), cluster.memory_gib.astype(float).copy(), gpus)

    def rows(self, index: np.ndarray) -> NodeState:
        return NodeState(self.cpus[index].copy(), self.memory_gib[index].copy(), self.gpus[index].copy())

    def whole_gpus(self) -> np.ndarray:
        return (self.gpus >= 1 - EPS).sum(axis=1)

    def fits(self, cpus: np.ndarray, memory_gib: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """(N, S): whether each node has room for each request (GPU shares < 1 on one GPU, else whole GPUs)."""
        gpus = np.asarray(gpus, float)
        room = (self.cpus[:, None] >= np.asarray(cpus)[None, :] - EPS) & (
            self.memory_gib[:, None] >= np.asarray(memory_gib)[None, :] - EPS)
        whole = self.whole_gpus()[:, None] >= np.round(gpus)[None, :]
        shared = self.gpus.max(axis=1)[:, None] >= gpus[None, :] - EPS
        return room & np.where(gpus[None, :] >= 1, whole, np.where(gpus[None, :] > 0, shared, True))


def shapes_of(instances: Sequence[Instance], cluster: Cluster) -> Shapes:
    """The target workload: the instances' distinct shapes that fit some node of the empty cluster, with their
    popularity among those (ATC'23's typical tasks, by count)."""
    counts = Counter(instance.shape for instance in instances)
    if not counts:
        return Shapes(*(np.zeros(0) for _ in range(4)))
    keys = sorted(counts)
    cpus, memory, gpus = (np.array(values, float) for values in zip(*keys, strict=True))
    placeable = NodeState.empty(cluster).fits(cpus, memory, gpus).any(axis=0)
    weights = np.array([counts[key] for key in keys], float) * placeable
    total = weights.sum()
    keep = weights > 0
    return Shapes(cpus[keep], memory[keep], gpus[keep], weights[keep] / (total if total else 1.0))


def node_fragmentation(state: NodeState, shapes: Shapes) -> dict[str, np.ndarray]:
    """``F_n(M)`` of every node of ``state`` for GPUs, CPUs and memory (the module's definition)."""
    n = len(state.cpus)
    if len(shapes) == 0:
        return {resource: np.zeros(n) for resource in RESOURCES}
    unfit = ~state.fits(shapes.cpus, shapes.memory_gib, shapes.gpus)
    free_gpus = state.gpus.sum(axis=1)
    result = {"cpus": state.cpus * (unfit @ shapes.requesting("cpus")),
              "memory_gib": state.memory_gib * (unfit @ shapes.requesting("memory_gib"))}
    weights = shapes.requesting("gpus")
    gpu = free_gpus * (unfit @ weights)
    thresholds = np.minimum(shapes.gpus, 1.0)
    for threshold in np.unique(thresholds[weights > 0]):  # fits, but GPUs with less free than it needs
        partial = (state.gpus * (state.gpus < threshold - EPS)).sum(axis=1)
        weight_fit = (~unfit[:, thresholds == threshold]) @ weights[thresholds == threshold]
        gpu = gpu + partial * weight_fit
    result["gpus"] = gpu
    return result


def node_stranded(state: NodeState, shapes: Shapes) -> dict[str, np.ndarray]:
    """Free resources of every node where no shape requesting that resource fits."""
    fits = state.fits(shapes.cpus, shapes.memory_gib, shapes.gpus)
    free = {"gpus": state.gpus.sum(axis=1), "cpus": state.cpus, "memory_gib": state.memory_gib}
    return {resource: np.where((fits & (getattr(shapes, resource) > 0)[None, :]).any(axis=1), 0.0, free[resource])
            for resource in RESOURCES}


def report(state: NodeState, cluster: Cluster, shapes: Shapes) -> dict[str, dict[str, float]]:
    """Per resource: capacity, allocated, free, ``fragmented`` (ATC'23 ``F(M)``) and ``stranded``, amounts and
    fractions of the capacity (``*_fraction``) and of the free amount (``fragmented_of_free``)."""
    fragmented, stranded = node_fragmentation(state, shapes), node_stranded(state, shapes)
    free = {"gpus": state.gpus.sum(axis=1), "cpus": state.cpus, "memory_gib": state.memory_gib}
    capacity = cluster.totals()
    result = {}
    for resource in RESOURCES:
        total, left = capacity[resource], float(free[resource].sum())
        amount, stuck = float(fragmented[resource].sum()), float(stranded[resource].sum())
        result[resource] = {
            "capacity": total, "allocated": total - left, "free": left, "fragmented": amount, "stranded": stuck,
            "fragmented_fraction": amount / total if total else 0.0,
            "stranded_fraction": stuck / total if total else 0.0,
            "fragmented_of_free": amount / left if left else 0.0,
        }
    return result
