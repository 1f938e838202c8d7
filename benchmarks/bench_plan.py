"""Cluster planning on Prism's own trace: what the monolithic and the disaggregated DLRM layouts strand as their
services arrive on a GPU cluster, placed by best-fit and by our fragmentation-aware policies (issue 45).

    .venv/bin/python -m benchmarks.bench_plan [--trace ../shared/traces/prism_disaggregated_DLRM_trace.csv]
        [--nodes ../shared/traces/openb_node_list_all_node.csv] [--seeds 10] [--ours fgd-reserve]

Method (Weng et al., "Beware of Fragmentation", USENIX ATC'23, as their simulator runs it: hkust-adsl/
kubernetes-scheduler-simulator, ``experiments/run_scripts/generate_run_scripts.py`` and
``pkg/simulator/simulator.go``): the trace's tasks are shuffled with a seed and, inflated by tasks drawn again from
the trace, submitted one by one until the arrived GPU requests reach 1.3 times the cluster's GPUs (``-tune 1.3``,
seeds 42 to 51); fragmentation is recorded after every task and plotted against the arrived workload in % of the
cluster's GPU capacity (``experiments/analysis/merge_frag_discrete.py``); their bar figures report the point at
which 100% has arrived (``experiments/plot/plot_openb_*_alloc_bar.py``). Their target workload (typical pods) is the
trace's own tasks, fixed for the whole run.

The scenario here, written down before any of its figures were seen:

- Pool: the instances of Prism's trace alive at its busiest moment (the most instances alive at once; 8,984
  instances of 146 services): the services as they were deployed together. (All 23,871 rows would count a service's
  replaced replicas as if they ran at once: 16,485 CN to 7,386 HN rows, against 5,604 to 3,380 alive together.)
- Arrivals (``autoconfig.planning.arrivals``): the pool's services in a seeded random order, each whole before the
  next (a second pass of copies once all have arrived, as the simulator draws tasks again); a service arrives one
  HN instance at a time, each with its share of the service's CN instances in the disaggregated layout and as that
  HN instance fused with its share (``services.FUSION_RULE``, unchanged) in the monolithic layout, so both layouts
  have the same CPUs, memory and GPUs arrived at every point (within one CN instance mid-service).
- Arrived workload: the CPUs, memory and GPUs requested so far, placed or not, as a share of the cluster's capacity
  on the workload's dominant resource (the largest of the three shares). ATC'23's axis is the GPU share because GPUs
  are their workload's dominant resource: their 8,152 openb tasks ask 98% of the openb list's GPUs, 68% of its CPUs
  and 50% of its memory, so even inflated to 130% of the GPUs they never ask for more CPUs or memory than the list
  has. Prism's DLRMs ask about 125 CPUs and 640 GiB per GPU, the list offers 20 CPUs and 96 GiB: measured on GPUs,
  the arrivals would ask 3.4 times the list's CPUs by 54% of its GPUs (the saturated regime of the busiest moment).
  The dominant share is the axis that reduces to ATC'23's for their workload. ATC'23's GPU axis taken literally is
  reported too (GPU points below).
- Points: 10%, 20%, ..., 130% of the dominant share (ATC'23 inflates to 130%); fragmentation measured after the
  first unit that reaches each point. GPU points: 50%, 90%, 100% and 110% of the cluster's GPUs, the same
  arrivals continued.
- Seeds 42 to 51 (ATC'23's ten), the same arrivals for every layout and policy of a seed; median, min and max.
- Target workload of the fragmentation measure and of ``fgd``/``fgd-reserve``: the pool's instance shapes in the
  layout placed (fixed over the sweep, as the simulator's typical pods). Definitions unchanged
  (``autoconfig.planning.fragmentation``).
- Summary point: 100% arrived on the dominant share, the point ATC'23 reports in its bar figures (a cluster whose
  capacity has arrived: crowded, not flooded); chosen by the method, before the figures. ``summary``:
  ``gpu_fragmentation_reduction`` and ``cpu_fragmentation_reduction``, 1 - (disaggregated with ``--ours``) /
  (monolithic with best-fit) of the fragmented GPUs and CPUs on ``openb``, per seed, the median over the seeds
  (min and max beside it in ``summary_spread``).
- Nodes needed to place every instance arrived at the summary point (first seed, best-fit and ``--ours``): the
  smallest prefix of the openb list repeated as often as needed, and for the homogeneous cluster the fewest GPU nodes
  that place every GPU instance beside ample CPU nodes, then the fewest CPU nodes beside those (bisection, assuming a
  larger cluster never places less).
- The trace as it was: the busiest moment's 8,984 instances placed at once in creation order (every layout and
  policy; no nodes needed), its reductions beside the summary's.

Clusters:
- ``openb``: the 1,523 nodes of ``openb_node_list_all_node.csv`` (``cluster-trace-gpu-v2023``), as listed.
- ``homogeneous``: as many nodes of the list's most common GPU node shape as the list has GPU nodes, and as many of
  one CPU-only shape as it has CPU-only nodes: the most common CPU-only shape, or where that cannot host the trace's
  most common CN instance shape, the most common CPU-only shape that can (stated in the results). Its arrivals are
  measured against its own capacity.

Writes results/bench_plan.{json,md} and results/bench_plan.png (fragmentation against the arrived workload).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autoconfig.planning.arrivals import Arrivals, arrivals
from autoconfig.planning.cluster import Cluster, NodeShape, most_common_shape, read_nodes
from autoconfig.planning.fragmentation import DEFINITIONS, NodeState, Shapes, node_fragmentation, report, shapes_of
from autoconfig.planning.placement import POLICIES, Placement, Policy, place
from autoconfig.planning.plan import Plan, make_plan, places_all, smallest, summary, unplaceable
from autoconfig.planning.services import (
    FUSION_RULE,
    LAYOUTS,
    TraceRow,
    Workload,
    read_trace,
    select,
    trace_workload,
)
from benchmarks.records import REPO, RESULTS, machine, provenance, write_results

TRACES = REPO.parent / "shared" / "traces"
BASELINE: Policy = "best-fit"
GOALS = {"gpu_fragmentation_reduction": 0.27, "cpu_fragmentation_reduction": 0.53}
MOST_COPIES = 64  # the openb list repeated at most this often when searching the nodes needed
POINTS = tuple(range(10, 131, 10))  # % of the dominant resource's capacity arrived
GPU_POINTS = (50, 90, 100, 110)  # % of the cluster's GPUs arrived (ATC'23's axis taken literally)
SUMMARY_POINT = 100
FIRST_SEED = 42
SWEEPS = {"dominant": POINTS, "gpus": GPU_POINTS}
SCENARIO = (
    "the instances alive at the trace's busiest moment (the services as deployed together) are the pool; its "
    "services arrive in a seeded random order (seeds {seeds}), each whole before the next (copies once all have "
    "arrived), one HN instance at a time with its share of the service's CN instances (disaggregated) or fused with "
    "that share (monolithic, the fusion rule unchanged); arrived = CPUs, memory and GPUs requested so far, placed or "
    "not, as a share of the cluster's capacity on the dominant resource (the largest of the three shares; for "
    "ATC'23's own workload, whose dominant resource is the GPU, their axis); fragmentation measured when 10%, 20%, "
    "..., 130% has arrived (and at 50, 90, 100 and 110% of the GPUs: ATC'23's axis taken literally), against the "
    "pool's instance shapes (fixed, as ATC'23's typical pods); summary at 100% arrived on the dominant share (the "
    "point of ATC'23's bar figures), median over the seeds of the per-seed reductions")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(TRACES / "prism_disaggregated_DLRM_trace.csv"))
    parser.add_argument("--nodes", default=str(TRACES / "openb_node_list_all_node.csv"))
    parser.add_argument("--seeds", type=int, default=10, help=f"arrival orders, seeds {FIRST_SEED} on")
    parser.add_argument("--ours", choices=POLICIES, default="fgd-reserve", help="the policy of the summary")
    parser.add_argument("--results", default=str(RESULTS), help="directory of bench_plan.{json,md,png}")
    parser.add_argument("--name", default="bench_plan")
    return parser


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def homogeneous(openb: Cluster, workload: Workload) -> tuple[Cluster, dict[str, Any]]:
    """The homogeneous cluster and why its shapes and counts (module docstring)."""
    gpu_shape, _ = most_common_shape(openb, gpu=True)
    cpu_shape, _ = most_common_shape(openb, gpu=False)
    gpu_nodes = int((openb.gpus > 0).sum())
    cpu_nodes = len(openb) - gpu_nodes
    typical = Counter(i.shape for i in workload.instances if i.gpus == 0).most_common(1)[0][0]

    def hosts(shape: NodeShape) -> bool:
        return shape.cpus >= typical[0] and shape.memory_gib >= typical[1]

    counts = Counter(s for s in openb.shapes() if s.gpus == 0 and hosts(s))
    chosen = cpu_shape if hosts(cpu_shape) else counts.most_common(1)[0][0]
    why = (f"{gpu_nodes} nodes of the most common GPU node shape ({gpu_shape.describe()}) and {cpu_nodes} of the "
           f"CPU-only shape {chosen.describe()}: the openb list's numbers of GPU and CPU-only nodes")
    if chosen != cpu_shape:
        why += (f"; the most common CPU-only shape ({cpu_shape.describe()}) cannot host the most common CPU-node "
                f"instance ({typical[0]:g} CPUs, {typical[1]:g} GiB), so the most common CPU-only shape that can")
    cluster = Cluster.homogeneous([(gpu_shape, gpu_nodes), (chosen, cpu_nodes)], prefix="homogeneous")
    return cluster, {"gpu_shape": gpu_shape.describe(), "gpu_nodes": gpu_nodes, "cpu_shape": chosen.describe(),
                     "cpu_nodes": cpu_nodes, "why": why}


def needed_openb(workload: Workload, openb: Cluster, policy: Policy, shapes: Shapes | None = None) -> dict[str, Any]:
    """The smallest prefix of the openb list, repeated as often as needed, that places every placeable instance."""
    skip = frozenset(unplaceable(workload, openb))
    high = len(openb)
    while not places_all(workload, openb.repeated(high), policy, skip=skip, shapes=shapes):
        if high >= MOST_COPIES * len(openb):
            placement = place(workload.instances, openb.repeated(high), policy, shapes=shapes)
            left = [i for i in placement.unplaced if i not in skip]
            return {"nodes": None, "why": f"{len(left)} placeable instance(s) still unplaced on {MOST_COPIES} copies "
                    f"of the list, e.g. {workload.instances[left[0]].name} "
                    f"({workload.instances[left[0]].shape}): {placement.reasons[left[0]]}",
                    "instances_that_fit_no_node": len(skip)}
        high *= 2
    nodes = smallest(lambda n: places_all(workload, openb.repeated(n), policy, skip=skip, shapes=shapes),
                     high // 2 + 1 if high > len(openb) else 1, high)
    return {"nodes": nodes, "copies_of_the_list": round(nodes / len(openb), 3), "instances_that_fit_no_node": len(skip)}


def needed_homogeneous(workload: Workload, gpu_shape: NodeShape, cpu_shape: NodeShape, policy: Policy,
                       shapes: Shapes | None = None) -> dict[str, Any]:
    """Fewest GPU nodes that place every placeable GPU instance beside ample CPU nodes, then fewest CPU nodes."""
    instances = workload.instances
    ample = sum(i.gpus == 0 for i in instances) + 1  # a CPU node for every CPU-only instance
    most_gpu = sum(i.gpus > 0 for i in instances) + 1

    def cluster(gpu_nodes: int, cpu_nodes: int) -> Cluster:
        return Cluster.homogeneous([(gpu_shape, gpu_nodes), (cpu_shape, cpu_nodes)])

    skip = frozenset(unplaceable(workload, cluster(1, 1)))
    gpu_instances = frozenset(i for i, instance in enumerate(instances) if instance.gpus > 0)
    gpu_skip = skip | (frozenset(range(len(instances))) - gpu_instances)
    gpu_nodes = smallest(lambda g: places_all(workload, cluster(g, ample), policy, skip=gpu_skip, shapes=shapes),
                         0, most_gpu)
    if gpu_nodes is None:
        return {"gpu_nodes": None, "cpu_nodes": None, "nodes": None, "why": "GPU instances left unplaced"}
    cpu_nodes = smallest(lambda c: places_all(workload, cluster(gpu_nodes, c), policy, skip=skip, shapes=shapes),
                         0, ample)
    return {"gpu_nodes": gpu_nodes, "cpu_nodes": cpu_nodes,
            "nodes": None if cpu_nodes is None else gpu_nodes + cpu_nodes, "instances_that_fit_no_node": len(skip)}


def where_stranded(state: NodeState, cluster: Cluster, shapes: Shapes) -> dict[str, float]:
    """Free and fragmented CPUs on GPU nodes and on CPU-only nodes: where the CPU fragmentation is."""
    fragmented = node_fragmentation(state, shapes)["cpus"]
    gpu_nodes = cluster.gpus > 0
    return {"free_cpus_gpu_nodes": float(state.cpus[gpu_nodes].sum()),
            "free_cpus_cpu_nodes": float(state.cpus[~gpu_nodes].sum()),
            "fragmented_cpus_gpu_nodes": float(fragmented[gpu_nodes].sum()),
            "fragmented_cpus_cpu_nodes": float(fragmented[~gpu_nodes].sum())}


def busiest_row(plan: Plan) -> dict[str, Any]:
    """One layout and policy of the busiest moment: the plan summary, placed and unplaced by pool and reason."""
    result = summary(plan, with_pools=False)
    result.pop("definitions")
    result["workload"] = {key: result["workload"][key] for key in ("instances", "demand")}
    placed = Counter(instance.pool for instance, node in zip(plan.workload.instances, plan.placement.nodes,
                                                             strict=True) if node >= 0)
    wanted = Counter(instance.pool for instance in plan.workload.instances)
    result["by_pool"] = {pool: {"instances": count, "placed": placed[pool]} for pool, count in wanted.items()}
    result["unplaced_by_reason"] = dict(Counter(reason.split(":")[0] for reason in plan.placement.reasons.values()))
    result["cpus_where"] = where_stranded(plan.placement.state, plan.cluster, plan.placement.shapes)
    return result


#: What each point of a sweep records, per seed.
MEASURES = ("arrived_instances", "arrived_cpus_share", "arrived_memory_share", "arrived_gpus_share", "placed",
            "unplaced", "unplaced_fits_no_node", "gpus_fragmented", "cpus_fragmented", "memory_fragmented",
            "gpus_fragmented_fraction", "cpus_fragmented_fraction", "memory_fragmented_fraction", "gpus_stranded",
            "cpus_stranded", "gpus_free", "cpus_free", "fragmented_cpus_gpu_nodes", "fragmented_cpus_cpu_nodes",
            "nodes_used")


def point(placement: Placement, count: int, cluster: Cluster, arrived: np.ndarray) -> dict[str, float]:
    """The measures (``MEASURES``) after the first ``count`` instances of a placement."""
    state = placement.snapshots[count]
    values = report(state, cluster, placement.shapes)
    nodes = placement.nodes[:count]
    unplaced = np.flatnonzero(nodes < 0)
    capacity = cluster.totals()
    where = where_stranded(state, cluster, placement.shapes)
    return {
        "arrived_instances": count, "arrived_cpus_share": float(arrived[0] / capacity["cpus"]),
        "arrived_memory_share": float(arrived[1] / capacity["memory_gib"]),
        "arrived_gpus_share": float(arrived[2] / capacity["gpus"]) if capacity["gpus"] else 0.0,
        "placed": int(count - len(unplaced)), "unplaced": len(unplaced),
        "unplaced_fits_no_node": sum(placement.reasons[int(i)].startswith("fits no node") for i in unplaced),
        **{f"{short}_fragmented": values[resource]["fragmented"] for short, resource in
           (("gpus", "gpus"), ("cpus", "cpus"), ("memory", "memory_gib"))},
        **{f"{short}_fragmented_fraction": values[resource]["fragmented_fraction"] for short, resource in
           (("gpus", "gpus"), ("cpus", "cpus"), ("memory", "memory_gib"))},
        "gpus_stranded": values["gpus"]["stranded"], "cpus_stranded": values["cpus"]["stranded"],
        "gpus_free": values["gpus"]["free"], "cpus_free": values["cpus"]["free"],
        "fragmented_cpus_gpu_nodes": where["fragmented_cpus_gpu_nodes"],
        "fragmented_cpus_cpu_nodes": where["fragmented_cpus_cpu_nodes"],
        "nodes_used": len(np.unique(nodes[nodes >= 0])),
    }


def reduction(ours: float, base: float) -> float:
    return 1 - ours / base if base else 0.0


def sweep(pool: Sequence[TraceRow], cluster: Cluster, shapes: dict[str, Shapes], seeds: Sequence[int],
          axis: str, points: Sequence[int]) -> tuple[dict[str, Any], dict[int, Arrivals]]:
    """Every seed's arrivals on ``cluster`` up to the last of ``points`` (% on ``axis``), placed in both layouts by
    every policy: per layout, policy and point, each measure as a list over the seeds."""
    capacity = cluster.totals()
    result: dict[str, Any] = {"axis": axis, "points": list(points), "seeds": list(seeds), "units": [],
                              "services_arrived": [], "rows": {}}
    orders = {}
    for seed in seeds:
        started = time.perf_counter()
        order = arrivals(pool, seed, capacity, max(points) / 100, axis)  # type: ignore[arg-type]
        orders[seed] = order
        reached = order.reached(capacity, [p / 100 for p in points], axis)  # type: ignore[arg-type]
        result["units"].append(reached)
        result["services_arrived"].append(len(order.services))
        for layout in LAYOUTS:
            instances = order.instances(layout)
            counts = [int(order.ends(layout)[units - 1]) for units in reached]
            for policy in POLICIES:
                placement = place(instances, cluster, policy, shapes=shapes[layout], snapshots=counts)
                by_point = result["rows"].setdefault(layout, {}).setdefault(policy, {})
                for percent, units, count in zip(points, reached, counts, strict=True):
                    values = point(placement, count, cluster, order.arrived[units - 1])
                    entry = by_point.setdefault(str(percent), {measure: [] for measure in MEASURES})
                    for measure in MEASURES:
                        entry[measure].append(values[measure])
        log(f"  seed {seed}: {len(order.units)} units, {len(order.services)} services "
            f"({time.perf_counter() - started:.1f} s)")
    return result, orders


def reductions(rows: dict[str, Any], ours: str, percent: int) -> dict[str, dict[str, Any]]:
    """Per resource, the per-seed reductions at ``percent`` (1 - ours / baseline) and their median, min and max."""
    result = {}
    for key, resource in (("gpu_fragmentation_reduction", "gpus"), ("cpu_fragmentation_reduction", "cpus")):
        mine = rows["disaggregated"][ours][str(percent)][f"{resource}_fragmented"]
        base = rows["monolithic"][BASELINE][str(percent)][f"{resource}_fragmented"]
        values = [reduction(a, b) for a, b in zip(mine, base, strict=True)]
        result[key] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                       "per_seed": values}
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows_read = read_trace(args.trace)
    pool, selection = select(rows_read, "busiest")
    workloads = {layout: trace_workload(pool, layout) for layout in LAYOUTS}
    openb = read_nodes(args.nodes)
    homogeneous_cluster, homogeneous_note = homogeneous(openb, workloads["disaggregated"])
    clusters = {"openb": openb, "homogeneous": homogeneous_cluster}
    seeds = list(range(FIRST_SEED, FIRST_SEED + args.seeds))
    sweeps: dict[str, dict[str, Any]] = {}
    busiest: dict[str, dict[str, dict[str, Any]]] = {}
    needed: dict[str, dict[str, dict[str, Any]]] = {}
    for name, cluster in clusters.items():
        shapes = {layout: shapes_of(workload.instances, cluster) for layout, workload in workloads.items()}
        for axis, points in SWEEPS.items():
            log(f"{name}: arrivals to {max(points)}% on {axis}")
            result, orders = sweep(pool, cluster, shapes, seeds, axis, points)
            sweeps.setdefault(axis, {})[name] = result
            if axis != "dominant":
                continue
            first = orders[seeds[0]]
            units = first.reached(cluster.totals(), [SUMMARY_POINT / 100])[0]
            for layout in LAYOUTS:
                arrived = Workload(layout, tuple(first.instances(layout, units)))
                for policy in (BASELINE, args.ours):
                    started = time.perf_counter()
                    shape_pair = homogeneous_cluster.shape(0), homogeneous_cluster.shape(len(homogeneous_cluster) - 1)
                    found = (needed_openb(arrived, openb, policy, shapes[layout]) if name == "openb" else
                             needed_homogeneous(arrived, *shape_pair, policy, shapes[layout]))
                    found["instances"] = len(arrived.instances)
                    found["seconds"] = round(time.perf_counter() - started, 1)
                    needed.setdefault(name, {}).setdefault(layout, {})[policy] = found
                    log(f"{name} {layout} {policy}: nodes needed at {SUMMARY_POINT}% (seed {seeds[0]}): {found}")
        for layout, workload in workloads.items():
            for policy in POLICIES:
                started = time.perf_counter()
                row = busiest_row(make_plan(workload, cluster, policy))
                row["seconds"] = round(time.perf_counter() - started, 2)
                busiest.setdefault(name, {}).setdefault(layout, {})[policy] = row
        log(f"{name}: busiest moment placed")

    def busiest_reduction(resource: str) -> float:
        ours = busiest["openb"]["disaggregated"][args.ours]["fragmentation"][resource]["fragmented"]
        base = busiest["openb"]["monolithic"][BASELINE]["fragmentation"][resource]["fragmented"]
        return reduction(ours, base)

    spread = reductions(sweeps["dominant"]["openb"]["rows"], args.ours, SUMMARY_POINT)
    created = np.array([row.created is not None for row in rows_read])
    return {
        "inputs": {
            "trace": str(args.trace), "nodes": str(args.nodes), "trace_rows": len(rows_read),
            "trace_rows_created_during_the_trace": int(created.sum()),
            "pool": selection, "scenario": SCENARIO.format(seeds=f"{seeds[0]} to {seeds[-1]}"),
            "seeds": seeds, "points": {"dominant": list(POINTS), "gpus": list(GPU_POINTS)},
            "summary_point": SUMMARY_POINT, "fusion_rule": FUSION_RULE,
            "not_modelled": "rdma_request and disk_request (the node list has no RDMA NICs or disks); GPU models "
                            "(the trace names none)",
            "clusters": {"openb": openb.describe(), "homogeneous": {**homogeneous_note,
                                                                    **homogeneous_cluster.describe()}},
            "pool_demand": {layout: workload.demand() for layout, workload in workloads.items()},
            "definitions": DEFINITIONS, "ours": args.ours, "baseline": BASELINE,
        },
        "rows": {"arrivals": sweeps["dominant"], "gpu_axis": sweeps["gpus"], "busiest": busiest},
        "nodes_needed": {"point": SUMMARY_POINT, "seed": seeds[0], **needed},
        "summary": {key: value["median"] for key, value in spread.items()},
        "summary_spread": spread,
        "busiest_summary": {"gpu_fragmentation_reduction": busiest_reduction("gpus"),
                            "cpu_fragmentation_reduction": busiest_reduction("cpus")},
        "goals": GOALS,
    }


# --- the report -------------------------------------------------------------------------------------------------

def _spread(values: Sequence[float], form: str = "{:.3f}") -> str:
    middle, low, high = statistics.median(values), min(values), max(values)
    if low == high:
        return form.format(middle)
    return f"{form.format(middle)} ({form.format(low)}-{form.format(high)})"


def _needed(needed: dict[str, Any] | None) -> str:
    if needed is None:
        return "-"
    if needed.get("nodes") is None:
        return needed.get("why", "none")
    if "gpu_nodes" in needed:
        return f"{needed['nodes']} ({needed['gpu_nodes']} GPU + {needed['cpu_nodes']} CPU)"
    return f"{needed['nodes']} ({needed['copies_of_the_list']}x the list)"


COMBOS = [(layout, policy) for layout in LAYOUTS for policy in POLICIES]


def _sweep_tables(result: dict[str, Any], ours: str, unit: str) -> list[str]:
    rows = result["rows"]
    lines = []
    for resource, title in (("gpus", "GPUs"), ("cpus", "CPUs")):
        lines += [f"{title} fragmented (fraction of the cluster's; median over the seeds, min-max in brackets):", "",
                  "| arrived " + unit + " | CPUs / memory / GPUs arrived | "
                  + " | ".join(f"{layout} {policy}" for layout, policy in COMBOS) + " | reduction |",
                  "|---|---|" + "---|" * len(COMBOS) + "---|"]
        for percent in result["points"]:
            first = rows["monolithic"][BASELINE][str(percent)]
            arrived = " / ".join(f"{statistics.median(first[f'arrived_{r}_share']):.2f}"
                                 for r in ("cpus", "memory", "gpus"))
            cells = [_spread(rows[layout][policy][str(percent)][f"{resource}_fragmented_fraction"])
                     for layout, policy in COMBOS]
            cut = reductions(rows, ours, percent)[f"{'gpu' if resource == 'gpus' else 'cpu'}_fragmentation_reduction"]
            lines.append(f"| {percent}% | {arrived} | " + " | ".join(cells)
                         + f" | {cut['median']:.3f} ({cut['min']:.3f}-{cut['max']:.3f}) |")
        lines.append("")
    return lines


def _point_table(result: dict[str, Any], percent: int, needed: dict[str, Any] | None) -> list[str]:
    rows = result["rows"]
    lines = ["| layout | policy | instances arrived | placed | unplaced (fit no node) | GPUs fragmented | "
             "CPUs fragmented | memory fragmented | GPUs stranded | CPUs stranded | fragmented CPUs on GPU / CPU-only "
             "nodes | nodes used | nodes needed to place all (seed " + str(result["seeds"][0]) + ") |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout, policy in COMBOS:
        at = rows[layout][policy][str(percent)]
        need = None if needed is None else needed.get(layout, {}).get(policy)
        count = "{:,.0f}"
        lines.append(
            f"| {layout} | {policy} | {_spread(at['arrived_instances'], count)} | {_spread(at['placed'], count)}"
            f" | {_spread(at['unplaced'], '{:,.0f}')} ({_spread(at['unplaced_fits_no_node'], '{:,.0f}')}) | "
            f"{_spread(at['gpus_fragmented_fraction'])} | {_spread(at['cpus_fragmented_fraction'])} | "
            f"{_spread(at['memory_fragmented_fraction'])} | {_spread(at['gpus_stranded'], '{:,.0f}')} | "
            f"{_spread(at['cpus_stranded'], '{:,.0f}')} | {_spread(at['fragmented_cpus_gpu_nodes'], '{:,.0f}')} / "
            f"{_spread(at['fragmented_cpus_cpu_nodes'], '{:,.0f}')} | {_spread(at['nodes_used'], '{:,.0f}')} | "
            f"{_needed(need)} |")
    return [*lines, ""]


def _fraction(row: dict[str, Any], resource: str, measure: str = "fragmented") -> str:
    values = row["fragmentation"][resource]
    return f"{values[f'{measure}_fraction']:.3f} ({values[measure]:,.0f})"


def report_text(results: dict[str, Any]) -> str:
    inputs = results["inputs"]
    ours, pool = inputs["ours"], inputs["pool"]
    openb = inputs["clusters"]["openb"]
    lines = [
        "# bench_plan: Prism's DLRM services arriving on a GPU cluster, placed monolithic and disaggregated", "",
        f"Commit `{results['commit']}`, {results['date']}: `{results['command']}` ({results['seconds']} s)", "",
        f"Trace: `{inputs['trace']}` ({inputs['trace_rows']} rows). Pool: {pool['instances']} instances, "
        f"{pool['rule']}, at {pool['moment']} s. Monolithic: {FUSION_RULE}. Not modelled: {inputs['not_modelled']}.",
        "",
        f"Scenario (ATC'23's Monte-Carlo workload inflation, by whole services; chosen before any figure was seen): "
        f"{inputs['scenario']}.", "",
        "Pool demand: " + "; ".join(f"{layout} {d['cpus']:,.0f} CPUs, {d['memory_gib']:,.0f} GiB, {d['gpus']:,.0f} "
                                    "GPUs" for layout, d in inputs["pool_demand"].items()) + ".", "",
        f"Clusters: `openb` = `{inputs['nodes']}` as listed ({openb['nodes']} nodes, {openb['cpus']:,.0f} CPUs, "
        f"{openb['memory_gib']:,.0f} GiB, {openb['gpus']:,.0f} GPUs); `homogeneous` = "
        f"{inputs['clusters']['homogeneous']['why']} ({inputs['clusters']['homogeneous']['cpus']:,.0f} CPUs, "
        f"{inputs['clusters']['homogeneous']['memory_gib']:,.0f} GiB, {inputs['clusters']['homogeneous']['gpus']:,.0f}"
        " GPUs).", "",
        "Fragmentation (fraction of the cluster's capacity): " + DEFINITIONS["fragmented"] + ". Stranded: "
        + DEFINITIONS["stranded"] + ". M is the pool's instance shapes in the layout placed.", "",
        "## Summary", "",
        f"Disaggregated with `{ours}` against monolithic with `{inputs['baseline']}` on `openb` when "
        f"{inputs['summary_point']}% of its capacity has arrived on the dominant resource (1 - ours / baseline, "
        f"fragmented amounts, per seed; median over {len(inputs['seeds'])} seeds, min-max in brackets), and the same "
        "comparison on the busiest moment's instances placed at once (the trace as it was):", "",
    ]
    for key, value in results["summary"].items():
        goal = results["goals"][key]
        spread = results["summary_spread"][key]
        verdict = "met" if value >= goal else f"missed by {goal - value:.3f}"
        lines.append(f"- `{key}` = {value:.3f} ({spread['min']:.3f}-{spread['max']:.3f}; goal >= {goal}: {verdict}); "
                     f"busiest moment: {results['busiest_summary'][key]:.3f}")
    lines.append("")
    if "figure" in results:
        lines += [f"Figure: `{results['figure']}` (fragmented GPUs and CPUs against the arrived workload, median "
                  "and min-max over the seeds).", ""]
    for name in ("openb", "homogeneous"):
        result = results["rows"]["arrivals"][name]
        lines += [f"## {name}: arrivals up to {max(result['points'])}% of the dominant resource", ""]
        lines += _sweep_tables(result, ours, "(dominant share)")
        lines += [f"At {inputs['summary_point']}% arrived (median, min-max over the seeds):", ""]
        lines += _point_table(result, inputs["summary_point"], results["nodes_needed"].get(name))
    for name in ("openb", "homogeneous"):
        result = results["rows"]["gpu_axis"][name]
        lines += [f"## {name}: ATC'23's axis taken literally (arrived GPU requests as a share of the GPUs)", ""]
        lines += _sweep_tables(result, ours, "(GPU share)")
    for name, layouts in results["rows"]["busiest"].items():
        lines += [f"## {name}: the busiest moment's {pool['instances']} instances placed at once, in creation order",
                  "",
                  "| layout | policy | placed | unplaced (fit no node) | GPUs fragmented | CPUs fragmented | "
                  "memory fragmented | GPUs stranded | CPUs stranded | fragmented CPUs on GPU / CPU-only nodes | "
                  "nodes used | unplaced by reason |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for layout, policies in layouts.items():
            for policy, row in policies.items():
                where = row["cpus_where"]
                reasons = ", ".join(f"{reason} {count}" for reason, count in row["unplaced_by_reason"].items()) or "-"
                lines.append(f"| {layout} | {policy} | {row['placed']} | {row['unplaced']} "
                             f"({row['unplaced_fits_no_node']}) | {_fraction(row, 'gpus')} | {_fraction(row, 'cpus')} "
                             f"| {_fraction(row, 'memory_gib')} | {_fraction(row, 'gpus', 'stranded')} | "
                             f"{_fraction(row, 'cpus', 'stranded')} | {where['fragmented_cpus_gpu_nodes']:,.0f} / "
                             f"{where['fragmented_cpus_cpu_nodes']:,.0f} | {row['nodes_used']} | {reasons} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Fragmented GPUs and CPUs against the arrived workload, per cluster: the four combinations of layout and
    baseline / ours, median and min-max over the seeds. False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = results["inputs"]["ours"]
    names = list(results["rows"]["arrivals"])
    figure, axes = plt.subplots(len(names), 2, figsize=(11, 4 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        result = results["rows"]["arrivals"][name]
        points = result["points"]
        for column, (resource, title) in enumerate((("gpus", "GPUs"), ("cpus", "CPUs"))):
            axis = axes[row][column]
            for (layout, policy), (color, style, marker) in zip(
                    [(layout, policy) for layout in LAYOUTS for policy in (BASELINE, ours)],
                    [("tab:blue", "--", "o"), ("tab:orange", "-", "x"), ("tab:green", "--", "s"),
                     ("tab:red", "-", "^")], strict=True):
                values = [result["rows"][layout][policy][str(p)][f"{resource}_fragmented_fraction"] for p in points]
                axis.plot(points, [100 * statistics.median(v) for v in values], style, color=color, marker=marker,
                          markersize=4, label=f"{layout}, {policy}")
                axis.fill_between(points, [100 * min(v) for v in values], [100 * max(v) for v in values],
                                  color=color, alpha=0.12)
            axis.axvline(results["inputs"]["summary_point"], color="grey", linestyle=":", linewidth=1)
            axis.set(xlabel="arrived workload (% of the capacity of its dominant resource)",
                     ylabel=f"{title} fragmented (% of the cluster's)", title=f"{name}: {title}")
            axis.grid(alpha=0.3)
            axis.set_xlim(0, max(points) + 5)
            axis.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = arguments().parse_args(argv)
    started = time.perf_counter()
    results = {**provenance(), "machine": machine(), **run(args)}
    directory = Path(args.results)
    directory.mkdir(parents=True, exist_ok=True)
    figure = directory / f"{args.name}.png"
    if plot(results, figure):
        results["figure"] = figure.name
    else:
        log("matplotlib is not installed: no figure")
    results["seconds"] = round(time.perf_counter() - started, 1)
    write_results(args.name, results, report_text(results), directory=directory)
    log(f"wrote {directory}/{args.name}.json and .md in {results['seconds']} s; summary {results['summary']}")
    return results


if __name__ == "__main__":
    main()
