"""Placement policies: each instance, in the workload's order, goes to one node with room for it, or is reported
unplaced with the reason.

- ``best-fit`` (the baseline): the node that the instance leaves with the least free resources, as the Best-fit
  plugin of the ATC'23 scheduler simulator scores it (``sum_r w_r (free_r - request_r) / max_r``, free after the
  placement over the largest node's capacity), over CPUs, memory and GPUs with equal weights.
- ``fgd`` (ours): Fragmentation Gradient Descent (Weng et al., ATC'23) over all three resources: the node whose
  fragmentation ``F_n(M)`` (``fragmentation.node_fragmentation``: GPUs, CPUs and memory, each over the largest
  node's capacity) grows least when the instance lands there; ties go to best-fit's choice. A CPU-only instance on
  a GPU node that it leaves without room for the workload's GPU instances strands that node's GPUs, so it goes to
  a CPU-only node while one has room; but once none has, it lands on a GPU node all the same.
- ``fgd-reserve`` (ours, the policy of Prism's layout: CPU-node instances on CPU nodes, GPU nodes for the GPU side):
  ``fgd``, except that a CPU-only instance may use a GPU node only where the node keeps, for each of its free GPUs,
  the CPUs and memory the workload's GPU instances need per GPU (their popularity-weighted mean CPUs and memory over
  their mean GPUs); an instance with no such room stays unplaced rather than strand GPUs.

Both are deterministic: equal scores go to the node first in the list. A node must have room for the instance's
CPUs, memory and GPUs (a share < 1 on one GPU, the tightest that has it; whole GPUs on GPUs with nothing
allocated) and hold fewer than ``max_per_node`` instances of its group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from autoconfig.planning.cluster import Cluster
from autoconfig.planning.fragmentation import EPS, NodeState, Shapes, node_fragmentation, shapes_of
from autoconfig.planning.services import Instance

Policy = Literal["best-fit", "fgd", "fgd-reserve"]
POLICIES: tuple[Policy, ...] = ("best-fit", "fgd", "fgd-reserve")
Progress = Callable[[int, int], None]


@dataclass
class Placement:
    """Where each instance went: ``nodes[i]`` is a node index, or -1 with ``reasons[i]`` saying why not."""

    instances: tuple[Instance, ...]
    cluster: Cluster
    policy: Policy
    nodes: np.ndarray
    reasons: dict[int, str]
    state: NodeState
    shapes: Shapes
    #: The nodes' free resources after the first ``n`` instances, for each ``n`` asked for (``place``'s
    #: ``snapshots``): a placement's state at an earlier point of its own arrivals.
    snapshots: dict[int, NodeState] = field(default_factory=dict)

    @property
    def unplaced(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.nodes < 0)]

    def nodes_used(self) -> int:
        return len(np.unique(self.nodes[self.nodes >= 0]))


def allocate(state: NodeState, cpus: float, memory_gib: float, gpus: float) -> None:
    """Take one request from every row of ``state`` (each row must have room): CPUs, memory, and a GPU share from
    the tightest GPU that has it, or whole GPUs from the first GPUs with nothing allocated."""
    state.cpus -= cpus
    state.memory_gib -= memory_gib
    if gpus >= 1:
        whole = state.gpus >= 1 - EPS
        state.gpus[whole & (np.cumsum(whole, axis=1) <= round(gpus))] = 0.0
    elif gpus > 0:
        room = np.where(state.gpus >= gpus - EPS, state.gpus, np.inf)
        state.gpus[np.arange(len(state.cpus)), np.argmin(room, axis=1)] -= gpus


def _best_fit_scores(state: NodeState, nodes: np.ndarray, instance: Instance, scale: np.ndarray) -> np.ndarray:
    left = np.stack([state.cpus[nodes] - instance.cpus, state.memory_gib[nodes] - instance.memory_gib,
                     state.gpus[nodes].sum(axis=1) - instance.gpus], axis=1)
    return (left / scale).sum(axis=1) / 3


def _unplaceable_reason(instance: Instance, cluster: Cluster) -> str:
    need = f"needs {instance.cpus:g} CPUs, {instance.memory_gib:g} GiB, {instance.gpus:g} GPUs"
    most = (f"the largest offer {cluster.cpus.max():g} CPUs, {cluster.memory_gib.max():g} GiB, "
            f"{cluster.gpus.max():g} GPUs")
    over = [name for name, asked, top in (("CPUs", instance.cpus, cluster.cpus.max()),
                                          ("memory", instance.memory_gib, cluster.memory_gib.max()),
                                          ("GPUs", instance.gpus, cluster.gpus.max())) if asked > top + EPS]
    if over:
        return f"fits no node: {need}; more {' and '.join(over)} than any node ({most})"
    return f"fits no node: {need}; no node offers all of it at once ({most})"


class _Chooser:
    """Picks the node for each instance among candidates, and keeps what the policy needs between choices."""

    def __init__(self, policy: Policy, state: NodeState, cluster: Cluster, shapes: Shapes):
        self.policy, self.state, self.shapes = policy, state, shapes
        self.scale = np.array([cluster.cpus.max(initial=1.0), cluster.memory_gib.max(initial=1.0),
                               max(1.0, float(cluster.gpus.max(initial=1)))])
        self.fragmentation = self._fragmentation(state) if policy != "best-fit" else None
        weights = shapes.requesting("gpus")
        per_gpu = float(weights @ shapes.gpus)
        self.reserve = (None if policy != "fgd-reserve" or per_gpu == 0 else
                        (float(weights @ shapes.cpus) / per_gpu, float(weights @ shapes.memory_gib) / per_gpu))

    def allowed(self, instance: Instance, candidates: np.ndarray) -> np.ndarray:
        """The candidates the policy lets ``instance`` use (``fgd-reserve``: a CPU-only instance only where the
        node keeps its free GPUs' share of CPUs and memory)."""
        if self.reserve is None or instance.gpus > 0:
            return candidates
        free_gpus = self.state.gpus[candidates].sum(axis=1)
        keep = ((self.state.cpus[candidates] - instance.cpus >= free_gpus * self.reserve[0] - EPS)
                & (self.state.memory_gib[candidates] - instance.memory_gib >= free_gpus * self.reserve[1] - EPS))
        return candidates[keep]

    def _fragmentation(self, state: NodeState) -> np.ndarray:
        parts = node_fragmentation(state, self.shapes)
        return (np.stack([parts["cpus"], parts["memory_gib"], parts["gpus"]], axis=1) / self.scale).sum(axis=1)

    def choose(self, instance: Instance, candidates: np.ndarray) -> int:
        fit = _best_fit_scores(self.state, candidates, instance, self.scale)
        if self.policy == "best-fit":
            return int(candidates[np.argmin(fit)])
        after = self.state.rows(candidates)
        allocate(after, instance.cpus, instance.memory_gib, instance.gpus)
        growth = np.round(self._fragmentation(after) - self.fragmentation[candidates], 9)
        steepest = np.flatnonzero(growth == growth.min())
        return int(candidates[steepest[np.argmin(fit[steepest])]])

    def placed(self, node: int) -> None:
        if self.fragmentation is not None:
            self.fragmentation[node] = self._fragmentation(self.state.rows(np.array([node])))[0]


def place(instances: Sequence[Instance], cluster: Cluster, policy: Policy, *, shapes: Shapes | None = None,
          progress: Progress | None = None, snapshots: Sequence[int] = ()) -> Placement:
    """Place ``instances`` in order on ``cluster`` with ``policy``; ``shapes`` is the target workload of the
    fragmentation measure (default: the instances' own shapes); ``snapshots``: counts ``n`` after whose first ``n``
    instances the nodes' free resources are kept (``Placement.snapshots``)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
    instances = tuple(instances)
    shapes = shapes_of(instances, cluster) if shapes is None else shapes
    state = NodeState.empty(cluster)
    chooser = _Chooser(policy, state, cluster, shapes)
    node_shape = np.unique(np.stack([cluster.cpus, cluster.memory_gib, cluster.gpus], axis=1), axis=0,
                           return_inverse=True)[1].ravel()
    touched = np.zeros(len(cluster), bool)
    in_group: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(len(cluster), int))
    empty = NodeState.empty(cluster)
    fits_somewhere: dict[tuple[float, float, float], bool] = {}
    whole, top = state.whole_gpus(), state.gpus.max(axis=1)  # kept up to date node by node
    nodes, reasons = np.full(len(instances), -1), {}
    wanted = {int(n) for n in snapshots}
    if any(n < 0 or n > len(instances) for n in wanted):
        raise ValueError(f"snapshots: counts from 0 to {len(instances)} (the instances placed)")
    kept: dict[int, NodeState] = {}
    everything = np.arange(len(cluster))
    for i, instance in enumerate(instances):
        if i in wanted:
            kept[i] = state.rows(everything)
        if progress is not None and i % 256 == 0:
            progress(i, len(instances))
        room = (state.cpus >= instance.cpus - EPS) & (state.memory_gib >= instance.memory_gib - EPS)
        if instance.gpus >= 1:
            room &= whole >= round(instance.gpus)
        elif instance.gpus > 0:
            room &= top >= instance.gpus - EPS
        if instance.shape not in fits_somewhere:
            request = (np.array([instance.cpus]), np.array([instance.memory_gib]), np.array([instance.gpus]))
            fits_somewhere[instance.shape] = bool(empty.fits(*request)[:, 0].any())
        if not fits_somewhere[instance.shape]:
            reasons[i] = _unplaceable_reason(instance, cluster)
            continue
        limit = instance.max_per_node
        allowed = room if limit is None else room & (in_group[instance.group] < limit)
        candidates = chooser.allowed(instance, np.flatnonzero(allowed))
        if len(candidates) == 0:
            held = bool((room & ~allowed).any())
            reasons[i] = ("no room left: every node with room already holds max_per_node "
                          f"{limit} instances of {instance.group}" if held else
                          "no room left: the nodes that could host it are full" if not allowed.any() else
                          "no room left outside the CPUs and memory GPU nodes keep for their free GPUs")
            continue
        fresh = ~touched[candidates]  # untouched nodes of one shape score alike: keep the first of each
        if fresh.sum() > 1:
            _, first = np.unique(node_shape[candidates[fresh]], return_index=True)
            candidates = np.sort(np.concatenate([candidates[~fresh], candidates[fresh][first]]))
        node = chooser.choose(instance, candidates)
        row = state.rows(np.array([node]))
        allocate(row, instance.cpus, instance.memory_gib, instance.gpus)
        state.cpus[node], state.memory_gib[node], state.gpus[node] = row.cpus[0], row.memory_gib[0], row.gpus[0]
        whole[node], top[node] = row.whole_gpus()[0], row.gpus[0].max()
        chooser.placed(node)
        touched[node] = True
        in_group[instance.group][node] += 1
        nodes[i] = node
    if len(instances) in wanted:
        kept[len(instances)] = state.rows(everything)
    if progress is not None:
        progress(len(instances), len(instances))
    return Placement(instances, cluster, policy, nodes, reasons, state, shapes, kept)
