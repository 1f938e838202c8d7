"""Cluster planning on Prism's own trace: what the monolithic and the disaggregated DLRM layouts strand, placed by
best-fit and by our fragmentation-aware policies (issue 45).

    .venv/bin/python -m benchmarks.bench_plan [--trace ../shared/traces/prism_disaggregated_DLRM_trace.csv]
        [--nodes ../shared/traces/openb_node_list_all_node.csv] [--moment busiest]

Workload: the instances of Prism's trace (NSDI'25, ``cluster-trace-gpu-v2025``) alive at its busiest moment (the
most instances alive at once), placed in creation order, instances alive since before the trace in file order.
Disaggregated: every CN (CPU-node) and HN (GPU-node) instance as the trace gives it. Monolithic: each HN instance
fused with an even share of its service's CN CPUs and memory (``autoconfig.planning.services.FUSION_RULE``).

Clusters:
- ``openb``: the 1,523 nodes of ``openb_node_list_all_node.csv`` (``cluster-trace-gpu-v2023``), as listed.
- ``homogeneous``: as many nodes of the list's most common GPU node shape as the list has GPU nodes, and as many of
  one CPU-only shape as it has CPU-only nodes: the most common CPU-only shape, or where that cannot host the trace's
  most common CN instance shape, the most common CPU-only shape that can (stated in the results).

Per cluster, layout and policy (``best-fit``, ``fgd``, ``fgd-reserve``): instances placed and left unplaced (and
why), fragmentation and stranded resources (``autoconfig.planning.fragmentation``: ATC'23's measure per resource),
and the nodes needed to place every instance that fits some node (best-fit and ``--ours`` only): the smallest
prefix of the openb list repeated as often as needed, and for the homogeneous cluster the fewest GPU nodes that
place every GPU instance beside ample CPU nodes, then the fewest CPU nodes beside those (bisection, assuming a
larger cluster never places less). ``summary``: ``gpu_fragmentation_reduction`` and ``cpu_fragmentation_reduction``,
1 - (disaggregated with ``--ours``) / (monolithic with best-fit), of the fragmented GPUs and CPUs on ``openb``.
Writes results/bench_plan.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autoconfig.planning.cluster import Cluster, NodeShape, most_common_shape, read_nodes
from autoconfig.planning.fragmentation import DEFINITIONS, NodeState
from autoconfig.planning.placement import POLICIES, Policy, place
from autoconfig.planning.plan import Plan, make_plan, places_all, smallest, summary, unplaceable
from autoconfig.planning.services import FUSION_RULE, LAYOUTS, Workload, read_trace, select, trace_workload
from benchmarks.records import REPO, RESULTS, machine, provenance, write_results

TRACES = REPO.parent / "shared" / "traces"
BASELINE: Policy = "best-fit"
GOALS = {"gpu_fragmentation_reduction": 0.27, "cpu_fragmentation_reduction": 0.53}
MOST_COPIES = 64  # the openb list repeated at most this often when searching the nodes needed


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(TRACES / "prism_disaggregated_DLRM_trace.csv"))
    parser.add_argument("--nodes", default=str(TRACES / "openb_node_list_all_node.csv"))
    parser.add_argument("--moment", default="busiest", help="busiest, all, or a time in seconds")
    parser.add_argument("--ours", choices=POLICIES, default="fgd-reserve", help="the policy of the summary")
    parser.add_argument("--results", default=str(RESULTS), help="directory of bench_plan.{json,md}")
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


def needed_openb(workload: Workload, openb: Cluster, policy: Policy) -> dict[str, Any]:
    """The smallest prefix of the openb list, repeated as often as needed, that places every placeable instance."""
    skip = frozenset(unplaceable(workload, openb))
    high = len(openb)
    while not places_all(workload, openb.repeated(high), policy, skip=skip):
        if high >= MOST_COPIES * len(openb):
            placement = place(workload.instances, openb.repeated(high), policy)
            left = [i for i in placement.unplaced if i not in skip]
            return {"nodes": None, "why": f"{len(left)} placeable instance(s) still unplaced on {MOST_COPIES} copies "
                    f"of the list, e.g. {workload.instances[left[0]].name} "
                    f"({workload.instances[left[0]].shape}): {placement.reasons[left[0]]}"}
        high *= 2
    nodes = smallest(lambda n: places_all(workload, openb.repeated(n), policy, skip=skip), high // 2 + 1
                     if high > len(openb) else 1, high)
    return {"nodes": nodes, "copies_of_the_list": round(nodes / len(openb), 3), "instances_that_fit_no_node": len(skip)}


def needed_homogeneous(workload: Workload, gpu_shape: NodeShape, cpu_shape: NodeShape,
                       policy: Policy) -> dict[str, Any]:
    """Fewest GPU nodes that place every placeable GPU instance beside ample CPU nodes, then fewest CPU nodes."""
    instances = workload.instances
    ample = sum(i.gpus == 0 for i in instances) + 1  # a CPU node for every CPU-only instance
    most_gpu = sum(i.gpus > 0 for i in instances) + 1

    def cluster(gpu_nodes: int, cpu_nodes: int) -> Cluster:
        return Cluster.homogeneous([(gpu_shape, gpu_nodes), (cpu_shape, cpu_nodes)])

    skip = frozenset(unplaceable(workload, cluster(1, 1)))
    gpu_instances = frozenset(i for i, instance in enumerate(instances) if instance.gpus > 0)
    gpu_skip = skip | (frozenset(range(len(instances))) - gpu_instances)
    gpu_nodes = smallest(lambda g: places_all(workload, cluster(g, ample), policy, skip=gpu_skip), 0, most_gpu)
    if gpu_nodes is None:
        return {"gpu_nodes": None, "cpu_nodes": None, "nodes": None, "why": "GPU instances left unplaced"}
    cpu_nodes = smallest(lambda c: places_all(workload, cluster(gpu_nodes, c), policy, skip=skip), 0, ample)
    return {"gpu_nodes": gpu_nodes, "cpu_nodes": cpu_nodes,
            "nodes": None if cpu_nodes is None else gpu_nodes + cpu_nodes, "instances_that_fit_no_node": len(skip)}


def where_stranded(plan: Plan) -> dict[str, float]:
    """Free and fragmented CPUs on GPU nodes and on CPU-only nodes: where the CPU fragmentation is."""
    from autoconfig.planning.fragmentation import node_fragmentation

    state: NodeState = plan.placement.state
    fragmented = node_fragmentation(state, plan.placement.shapes)["cpus"]
    gpu_nodes = plan.cluster.gpus > 0
    return {"free_cpus_gpu_nodes": float(state.cpus[gpu_nodes].sum()),
            "free_cpus_cpu_nodes": float(state.cpus[~gpu_nodes].sum()),
            "fragmented_cpus_gpu_nodes": float(fragmented[gpu_nodes].sum()),
            "fragmented_cpus_cpu_nodes": float(fragmented[~gpu_nodes].sum())}


def row(plan: Plan) -> dict[str, Any]:
    result = summary(plan, with_pools=False)
    result.pop("definitions")
    result["workload"] = {key: result["workload"][key] for key in ("instances", "demand")}
    placed = Counter(instance.pool for instance, node in zip(plan.workload.instances, plan.placement.nodes,
                                                             strict=True) if node >= 0)
    wanted = Counter(instance.pool for instance in plan.workload.instances)
    result["by_pool"] = {pool: {"instances": count, "placed": placed[pool]} for pool, count in wanted.items()}
    result["unplaced_by_reason"] = dict(Counter(reason.split(":")[0] for reason in plan.placement.reasons.values()))
    result["cpus_where"] = where_stranded(plan)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows_read = read_trace(args.trace)
    chosen, selection = select(rows_read, args.moment)
    workloads = {layout: trace_workload(chosen, layout) for layout in LAYOUTS}
    openb = read_nodes(args.nodes)
    homogeneous_cluster, homogeneous_note = homogeneous(openb, workloads["disaggregated"])
    clusters = {"openb": openb, "homogeneous": homogeneous_cluster}
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for name, cluster in clusters.items():
        for layout, workload in workloads.items():
            for policy in POLICIES:
                started = time.perf_counter()
                plan = make_plan(workload, cluster, policy)
                result = row(plan)
                result["seconds"] = round(time.perf_counter() - started, 2)
                if policy in (BASELINE, args.ours):
                    started = time.perf_counter()
                    shapes = homogeneous_cluster.shape(0), homogeneous_cluster.shape(len(homogeneous_cluster) - 1)
                    result["nodes_needed"] = (needed_openb(workload, openb, policy) if name == "openb" else
                                              needed_homogeneous(workload, *shapes, policy))
                    result["nodes_needed"]["seconds"] = round(time.perf_counter() - started, 1)
                rows.setdefault(name, {}).setdefault(layout, {})[policy] = result
                log(f"{name} {layout} {policy}: {result['placed']} placed, {result['unplaced']} not, GPUs fragmented "
                    f"{result['fragmentation']['gpus']['fragmented_fraction']:.3f}, CPUs "
                    f"{result['fragmentation']['cpus']['fragmented_fraction']:.3f}"
                    + (f", nodes needed {result['nodes_needed']}" if "nodes_needed" in result else ""))
    ours, baseline = rows["openb"]["disaggregated"][args.ours], rows["openb"]["monolithic"][BASELINE]

    def reduction(resource: str) -> float:
        base = baseline["fragmentation"][resource]["fragmented"]
        return 1 - ours["fragmentation"][resource]["fragmented"] / base if base else 0.0

    created = np.array([row.created is not None for row in rows_read])
    return {
        "inputs": {
            "trace": str(args.trace), "nodes": str(args.nodes), "trace_rows": len(rows_read),
            "trace_rows_created_during_the_trace": int(created.sum()),
            "selection": selection, "order": "creation time; instances alive since before the trace first, in "
            "file order", "fusion_rule": FUSION_RULE,
            "not_modelled": "rdma_request and disk_request (the node list has no RDMA NICs or disks); GPU models "
                            "(the trace names none)",
            "clusters": {"openb": openb.describe(), "homogeneous": {**homogeneous_note,
                                                                    **homogeneous_cluster.describe()}},
            "demand": {layout: workload.demand() for layout, workload in workloads.items()},
            "definitions": DEFINITIONS, "ours": args.ours, "baseline": BASELINE,
        },
        "rows": rows,
        "summary": {"gpu_fragmentation_reduction": reduction("gpus"),
                    "cpu_fragmentation_reduction": reduction("cpus")},
        "goals": GOALS,
    }


def _fraction(row: dict[str, Any], resource: str, measure: str = "fragmented") -> str:
    values = row["fragmentation"][resource]
    return f"{values[f'{measure}_fraction']:.3f} ({values[measure]:,.0f})"


def _needed(row: dict[str, Any]) -> str:
    needed = row.get("nodes_needed")
    if needed is None:
        return "-"
    if needed.get("nodes") is None:
        return needed.get("why", "none")
    if "gpu_nodes" in needed:
        return f"{needed['nodes']} ({needed['gpu_nodes']} GPU + {needed['cpu_nodes']} CPU)"
    return f"{needed['nodes']} ({needed['copies_of_the_list']}x the list)"


def report(results: dict[str, Any]) -> str:
    inputs, summary_values = results["inputs"], results["summary"]
    selection, openb = inputs["selection"], inputs["clusters"]["openb"]
    lines = [
        "# bench_plan: Prism's DLRM trace placed monolithic and disaggregated", "",
        f"Commit `{results['commit']}`, {results['date']}: `{results['command']}`", "",
        f"Workload: {selection['instances']} instances of `{inputs['trace']}` ({inputs['trace_rows']} rows): "
        f"{selection['rule']}, at {selection['moment']} s. Order: {inputs['order']}. Monolithic: {FUSION_RULE}. "
        f"Not modelled: {inputs['not_modelled']}.", "",
        "Demand: " + "; ".join(f"{layout} {d['cpus']:,.0f} CPUs, {d['memory_gib']:,.0f} GiB, {d['gpus']:,.0f} GPUs"
                               for layout, d in inputs["demand"].items()) + ".", "",
        f"Clusters: `openb` = `{inputs['nodes']}` as listed ({openb['nodes']} nodes, {openb['cpus']:,.0f} CPUs, "
        f"{openb['memory_gib']:,.0f} GiB, {openb['gpus']:,.0f} GPUs); `homogeneous` = "
        f"{inputs['clusters']['homogeneous']['why']}.",
        "",
        "Fragmentation (fraction of the cluster's capacity, amount in brackets): " + DEFINITIONS["fragmented"] + ". "
        "Stranded: " + DEFINITIONS["stranded"] + ".", "",
    ]
    for name, layouts in results["rows"].items():
        lines += [f"## {name}", "",
                  "| layout | policy | placed | unplaced (fit no node) | GPUs fragmented | CPUs fragmented | "
                  "memory fragmented | GPUs stranded | CPUs stranded | nodes used | nodes needed to place all |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for layout, policies in layouts.items():
            for policy, row in policies.items():
                lines.append(f"| {layout} | {policy} | {row['placed']} | {row['unplaced']} "
                             f"({row['unplaced_fits_no_node']}) | {_fraction(row, 'gpus')} | {_fraction(row, 'cpus')} "
                             f"| {_fraction(row, 'memory_gib')} | {_fraction(row, 'gpus', 'stranded')} | "
                             f"{_fraction(row, 'cpus', 'stranded')} | {row['nodes_used']} | {_needed(row)} |")
        lines.append("")
        lines += ["Where the free and fragmented CPUs are (GPU nodes / CPU-only nodes):", "",
                  "| layout | policy | free CPUs | fragmented CPUs | placed by pool | unplaced by reason |",
                  "|---|---|---|---|---|---|"]
        for layout, policies in layouts.items():
            for policy, row in policies.items():
                where = row["cpus_where"]
                pools = ", ".join(f"{pool} {v['placed']}/{v['instances']}" for pool, v in row["by_pool"].items())
                reasons = ", ".join(f"{reason} {count}" for reason, count in row["unplaced_by_reason"].items()) or "-"
                lines.append(f"| {layout} | {policy} | {where['free_cpus_gpu_nodes']:,.0f} / "
                             f"{where['free_cpus_cpu_nodes']:,.0f} | {where['fragmented_cpus_gpu_nodes']:,.0f} / "
                             f"{where['fragmented_cpus_cpu_nodes']:,.0f} | {pools} | {reasons} |")
        lines.append("")
    lines += ["## Summary", "",
              f"Disaggregated with `{inputs['ours']}` against monolithic with `{inputs['baseline']}` on `openb` "
              "(1 - ours / baseline, fragmented amounts):", ""]
    for key, value in summary_values.items():
        goal = results["goals"][key]
        verdict = "met" if value >= goal else f"missed by {goal - value:.3f}"
        lines.append(f"- `{key}` = {value:.3f} (goal >= {goal}: {verdict})")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = arguments().parse_args(argv)
    started = time.perf_counter()
    results = {**provenance(), "machine": machine(), **run(args)}
    results["seconds"] = round(time.perf_counter() - started, 1)
    write_results(args.name, results, report(results), directory=Path(args.results))
    log(f"wrote {args.results}/{args.name}.json and .md in {results['seconds']} s; summary {results['summary']}")
    return results


if __name__ == "__main__":
    main()
