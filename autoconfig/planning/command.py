"""What ``autoconfig plan`` does around a plan: read and check every input before placing anything, report
progress on stderr, print the plan and write its files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ray.serve.schema import ServeDeploySchema
from rich.table import Table

from autoconfig.planning.cluster import Cluster, read_nodes
from autoconfig.planning.inputs import PlanInputError
from autoconfig.planning.placement import Progress
from autoconfig.planning.plan import Plan, details, pools
from autoconfig.planning.serve_plan import (
    ServePlanError,
    check_template,
    serve_config,
    worker_groups,
    write_worker_groups,
)
from autoconfig.planning.services import Workload, is_trace, read_services, read_trace, select, trace_workload
from autoconfig.serve_config import ServeConfigError, load_serve_config

#: Errors that refuse the inputs (exit code 2) before any placement.
INPUT_ERRORS = (PlanInputError, ServePlanError, ServeConfigError)


@dataclass
class Inputs:
    workload: Workload
    cluster: Cluster
    template: ServeDeploySchema | None


def load_inputs(args: argparse.Namespace) -> Inputs:
    """The workload (a trace CSV or a service file in ``args.layout``), the node list and, when a Serve config is
    to be written, its template, each checked; raises one of ``INPUT_ERRORS``."""
    cluster = read_nodes(args.nodes)
    if is_trace(args.services):
        if args.serve_config or args.worker_groups:
            raise PlanInputError(f"{args.services}: a trace describes no Serve application; --serve-config and "
                                 "--worker-groups need a service file (YAML or JSON) whose services name an app")
        rows, note = select(read_trace(args.services), args.moment)
        workload = trace_workload(rows, args.layout, {"source": str(args.services), **note})
    else:
        workload = read_services(args.services, args.layout)
    template = None
    if args.serve_config or args.worker_groups:
        template = load_serve_config(args.template)
        if not any(pool.app for pool in workload.pools):
            raise PlanInputError(f"{args.services}: no service names an app (services[i].app) to write")
        check_template(template, workload)
    return Inputs(workload, cluster, template)


def stderr_progress(every_s: float = 2.0) -> Progress:
    """A progress callback that prints to stderr once a placement has run ``every_s`` seconds, then every
    ``every_s`` seconds and at the end."""
    started = time.monotonic()
    last = started

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s or (done == total and now - started >= every_s):
            print(f"placing: {done}/{total} instances ({now - started:.0f} s)", file=sys.stderr, flush=True)
            last = now

    return report


def plan_tables(plan: Plan, *, most: int = 20) -> list[Table]:
    """Pools (replicas wanted and placed, the nodes of the first ``most``), fragmentation, and the reasons
    instances went unplaced."""
    table = Table(title=f"{plan.workload.layout} layout, {plan.placement.policy} on {len(plan.cluster)} nodes")
    for column in ("service", "pool", "replicas", "placed", "nodes"):
        table.add_column(column)
    rows = pools(plan)
    for row in rows[:most]:
        on = ", ".join(f"{node} x{count}" for node, count in list(row["nodes"].items())[:4])
        more = len(row["nodes"]) - 4
        table.add_row(row["service"], row["pool"], str(row["replicas"]), str(row["placed"]),
                      on + (f" (+{more} nodes)" if more > 0 else ""))
    if len(rows) > most:
        table.caption = f"{len(rows) - most} more pools in the plan file"
    stranded = Table(title="what the placement strands (fraction of the cluster's capacity)")
    for column in ("resource", "capacity", "allocated", "free", "fragmented (ATC'23)", "stranded"):
        stranded.add_column(column)
    for resource, values in plan.fragmentation.items():
        stranded.add_row(resource, f"{values['capacity']:.6g}", f"{values['allocated']:.6g}", f"{values['free']:.6g}",
                         f"{values['fragmented']:.6g} ({values['fragmented_fraction']:.1%})",
                         f"{values['stranded']:.6g} ({values['stranded_fraction']:.1%})")
    tables = [table, stranded]
    reasons = Counter(reason.split(":")[0] for reason in plan.placement.reasons.values())
    if reasons:
        unplaced = Table(title=f"{len(plan.placement.unplaced)} instance(s) not placed (each with its reason in the "
                         "plan file)")
        for column in ("instances", "why", "e.g."):
            unplaced.add_column(column)
        for kind, count in reasons.most_common():
            example = next(reason for reason in plan.placement.reasons.values() if reason.split(":")[0] == kind)
            unplaced.add_row(str(count), kind, example.removeprefix(kind + ": "))
        tables.append(unplaced)
    return tables


def write_outputs(plan: Plan, args: argparse.Namespace, template: ServeDeploySchema | None) -> list[str]:
    """Write the plan JSON and, when asked, the Serve config and the KubeRay worker groups; what was written."""
    from autoconfig.knobs import write_serve_config

    written = []
    if args.out:
        Path(args.out).write_text(json.dumps(details(plan), indent=1) + "\n")
        written.append(f"wrote the plan to {args.out}")
    if args.serve_config and template is not None:
        write_serve_config(serve_config(template, plan), args.serve_config)
        written.append(f"wrote the Serve config to {args.serve_config} (check: autoconfig check {args.serve_config})")
    if args.worker_groups:
        write_worker_groups(worker_groups(plan), args.worker_groups)
        written.append(f"wrote the KubeRay worker groups to {args.worker_groups}")
    return written
