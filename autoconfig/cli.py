"""The ``autoconfig`` command line: ``check``, ``tune``, ``profile``, ``evaluate``, ``report`` and ``plan``.

Each subcommand's ``--help`` says what it does (docs/AUTOCONFIG.md: how trials and studies work). ``main`` returns
the exit code; ``tune`` stopped by Ctrl-C or SIGTERM keeps its finished trials and returns 130 or 143.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from autoconfig import __version__

#: ``tune --searcher`` choices (``autoconfig.searchers.SEARCHERS``, named here so ``--help`` needs no import of it).
SEARCHER_NAMES = ("grid", "random", "tpe", "gp", "meta", "rgpe", "best-on-average", "prior-only", "tpe-warm",
                  "pareto")
#: ``--gpu-share-mode`` choices (``autoconfig.gpu_share.GpuShareMode``).
GPU_SHARE_MODE_NAMES = ("mps", "memory", "schedule")


def _check(args: argparse.Namespace, console: Console) -> int:
    from autoconfig.gpu_share import gpu_overcommit
    from autoconfig.serve_config import ServeConfigError, check_models, load_serve_config

    try:
        config = load_serve_config(args.config)
        overflow = gpu_overcommit(config)
        if overflow is not None:
            raise ServeConfigError(f"{args.config}: {overflow}")
        reports = check_models(config, source=str(args.config))
    except ServeConfigError as exc:
        console.print(f"[red]invalid:[/red] {exc}", soft_wrap=True)
        return 1
    except ValueError as exc:  # a GPU share that is not a number
        console.print(f"[red]invalid:[/red] {args.config}: {exc}", soft_wrap=True)
        return 1
    table = Table(title=f"{args.config} (HTTP {config.http_options.host}:{config.http_options.port})")
    for column in ("application", "route", "import path", "deployment", "replicas", "resources"):
        table.add_column(column)
    for app in config.applications:
        for deployment in app.deployments or []:
            fields = deployment.model_dump(exclude_unset=True)
            table.add_row(app.name, app.route_prefix, app.import_path, deployment.name,
                          str(fields.get("num_replicas", "default")), str(fields.get("ray_actor_options", {})))
    console.print(table)
    for name, report in reports.items():
        console.print(f"{name}: model {report.label}, {len(report.tables)} embedding table(s)", soft_wrap=True)
        for note in report.notes:
            console.print(f"[yellow]note:[/yellow] {name}: {note}", soft_wrap=True)
    console.print(f"[green]ok:[/green] {len(config.applications)} application(s) valid")
    return 0


def _tune(args: argparse.Namespace, console: Console) -> int:
    from autoconfig.tune_command import run_tune

    return run_tune(args, console)


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    from autoconfig.bank import BankEntry, BankError, load_bank, measured_by
    from autoconfig.evaluate import plot_progress, replay_table, selected
    from autoconfig.replay import replay
    from autoconfig.searchers import SEARCHERS

    try:
        entries = load_bank(args.bank)
        names = selected(args.searchers.split(","), list(SEARCHERS))
    except (BankError, ValueError) as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        return 2
    if len(entries) < 2:
        console.print(f"[red]error:[/red] {args.bank}: leave-one-model-out needs at least 2 profiled models",
                      soft_wrap=True)
        return 2
    for where, measurers in (("at {} code versions", measured_by(entries)),
                             ("on {} machines", measured_by(entries, BankEntry.machines))):
        if len(measurers) > 1:
            named = "; ".join(f"{measurer or 'not recorded'}: {', '.join(models)}"
                              for measurer, models in measurers.items())
            console.print(f"[yellow]warning:[/yellow] {args.bank} was measured {where.format(len(measurers))}, so "
                          f"its surfaces may differ by more than the models ({named})", soft_wrap=True)
    factories = {name: SEARCHERS[name] for name in names}
    with Progress(console=console) as progress:
        bar = progress.add_task("replaying", total=len(names) * len(entries) * args.seeds)
        result = replay(factories, entries, seeds=range(args.seeds), budget=args.budget, tolerance=args.tolerance,
                        on_run=lambda *_: progress.advance(bar))
    console.print(replay_table(result))
    console.print(f"plot: {plot_progress(result, args.plot, trials=args.budget)}")
    return 0


def _report(args: argparse.Namespace, console: Console) -> int:
    from autoconfig.bank import BankEntry, BankError
    from autoconfig.report import plot_report
    from autoconfig.searchers.base import Observation
    from autoconfig.study import StudyError, TuningStudy
    from autoconfig.tune_command import print_front, print_trials
    from autoconfig.tuner import best_observation

    try:
        if args.bank_entry:
            entry = BankEntry.load(args.bank_entry)
            space, title, objective = entry.space, f"profile {entry.name}", entry.objective
            history = [Observation(trial.config, trial.objective) for trial in entry.trials]
            records = [{"config": trial.config.as_dict(), "status": trial.status, "sustainable_rps": trial.rps or 0.0,
                        "achieved_rps": trial.achieved_rps, "p99_ms": trial.p99_ms, "memory_mib": trial.memory_mib,
                        "objective": trial.objective or 0.0} for trial in entry.trials]
        else:
            study = TuningStudy.load(args.storage, args.study)
            space, title = study.space, f"study {study.name}"
            history, records = study.history(), study.records()
            objective = records[0].get("objective_name", "objective") if records else "objective"
    except (BankError, StudyError) as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        return 2
    if not history:
        console.print(f"[red]error:[/red] {title} has no finished trial", soft_wrap=True)
        return 1
    print_trials(console, records)
    best = best_observation(history)
    if best is None:
        console.print(f"{len(history)} trials; [red]none met the SLO[/red]")
    else:
        console.print(f"{len(history)} trials of {space.size}; best {best.config.as_dict()} "
                      f"({objective} {best.value:.2f}, found at trial {history.index(best) + 1})")
    print_front(console, records)
    console.print(f"plot: {plot_report(space, history, args.plot, title=title, objective=objective, records=records)}")
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    from autoconfig.planning.command import INPUT_ERRORS, load_inputs, plan_tables, stderr_progress, write_outputs
    from autoconfig.planning.plan import make_plan

    try:
        inputs = load_inputs(args)
    except INPUT_ERRORS as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        return 2
    plan = make_plan(inputs.workload, inputs.cluster, args.policy, progress=stderr_progress())
    for table in plan_tables(plan):
        console.print(table)
    for line in write_outputs(plan, args, inputs.template):
        console.print(line, soft_wrap=True)
    unplaced = len(plan.placement.unplaced)
    if unplaced:
        console.print(f"[yellow]{unplaced} of {len(plan.workload.instances)} instance(s) not placed[/yellow]")
    return 1 if unplaced else 0


def _trial_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``tune`` and ``profile`` share: the application, the SLO, the study and how trials measure."""
    parser.add_argument("--config", default="deploy/serve_config.yaml", help="Serve config template")
    parser.add_argument("--app", required=True, help="application of the config to tune (e.g. dlrm)")
    parser.add_argument("--slo-p99-ms", type=float, required=True, help="p99 latency SLO in milliseconds")
    parser.add_argument("--space", help="search space YAML (shortcut knobs and/or dotted paths into the app's "
                        "deployments), or a shipped space's name: dlrm, diffusion, dlrm-joint, diffusion-joint "
                        "(default for the built-in apps: the one for the app's kind)")
    parser.add_argument("--storage", default="sqlite:///autoconfig.db", help="Optuna storage URL")
    parser.add_argument("--study", help="study name (default: APP-SEARCHER); an existing study is resumed")
    parser.add_argument("--objective", choices=("rate_per_share", "max_rate"), default="rate_per_share")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--gpu-share-mode", choices=GPU_SHARE_MODE_NAMES, default=None,
                        help="what a GPU device_share divides (--accelerator gpu): mps, compute and memory (each "
                             "replica's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and memory fraction; needs an MPS control "
                             "daemon on every GPU node); memory, memory only (compute is time-sliced); schedule, "
                             "Ray's fractional num_gpus alone (default: mps where every GPU node's daemon answers, "
                             "else memory, with a warning)")
    parser.add_argument("--probe-s", type=float, default=1.0,
                        help="seconds of a scouting probe (the doubling) and of the shortest deciding probe")
    parser.add_argument("--min-requests", type=int, default=200,
                        help="requests of a deciding probe (the reported rate and those found too high)")
    parser.add_argument("--start-rps", type=float, default=1.0, help="first request rate probed")
    parser.add_argument("--max-probes", type=int, default=24, help="most probes per trial")
    parser.add_argument("--tolerance", type=float, default=0.025,
                        help="relative precision of the sustainable rate (the bisection's last step)")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--workload", default=None,
                        help="FILE.jsonl of request templates (any app; format: docs/AUTOCONFIG.md), or, for the "
                             "built-in apps, request options KEY=VALUE[,...]: dlrm rows_per_request, pool_size, seed, "
                             "variable_size (a DLRM app's own model, preset or factory, shapes the requests); "
                             "diffusion steps, size, n, pool_size, controlnets (names joined by +), loras "
                             "(combinations separated by |, names joined by +, an empty one no LoRA) (default: one "
                             "small request of the app's model)")
    parser.add_argument("--max-interference", type=float, default=None, metavar="FRACTION",
                        help="measure a trial (or repeat run) again when its rate search lost this share of the "
                             "node's CPUs or more to the hypervisor or to other processes, e.g. 0.1 (default: "
                             "measure once and warn)")
    parser.add_argument("--interference-retries", type=int, default=2,
                        help="most measurements again per trial under --max-interference; the last is kept")
    parser.add_argument("--fresh-deploy", action="store_true",
                        help="delete and redeploy the app for every trial (default: update the kept trial app "
                             "in place; Serve restarts replicas only when resources or threads change)")


def _repeat_arguments(parser: argparse.ArgumentParser, runs: int, why: str) -> None:
    parser.add_argument("--repeat-best", type=int, default=3, help=f"configurations measured again (the best ones) "
                        f"{why}")
    parser.add_argument("--repeats", type=int, default=runs, help="measurements of each of them, the first "
                        "included (1: none repeated)")
    parser.add_argument("--repeat-limit", type=int, default=None, help="most configurations measured again "
                        "(default: twice --repeat-best): after each one's runs the best are ranked again by their "
                        "means, so one whose first run was lucky drops out and lets the next in")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoconfig", description="Configure swiftserve deployments.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a Ray Serve config file, its application args and the "
                                "models of its DLRM apps")
    check.add_argument("config", help="path to a Serve config YAML (e.g. deploy/serve_config.yaml)")
    check.set_defaults(run=_check)

    tune = commands.add_parser("tune", help="search the configuration of one application under a p99 SLO")
    _trial_arguments(tune)
    tune.add_argument("--budget", type=int, default=12, help="finished trials the study should hold")
    tune.add_argument("--searcher", choices=SEARCHER_NAMES, default="tpe",
                      help="meta, rgpe, best-on-average, prior-only and tpe-warm learn from --bank; pareto spreads "
                           "trials along the front of objective and p99 (multi-objective TPE, limits as constraints)")
    tune.add_argument("--bank", help="profile bank directory (the meta searcher learns from it)")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--out", default="tuned_serve_config.yaml", help="where to write the chosen Serve config")
    tune.add_argument("--max-memory-mib", type=float, default=None, help="limit: a configuration whose replicas "
                      "hold more resident memory than this (measured after its load) counts as not met")
    tune.add_argument("--front-out", default=None, help="JSON file for the Pareto front (objective, p99, memory)")
    _repeat_arguments(tune, runs=2, why="after the budget; the one with the best mean is written to --out (the best "
                      "single run is often a lucky one)")
    tune.set_defaults(run=_tune)

    profile = commands.add_parser("profile", help="profile every configuration of the space into a bank entry")
    _trial_arguments(profile)
    profile.add_argument("--bank", required=True, help="profile bank directory to write MODEL_NAME.json into")
    profile.add_argument("--model-name", required=True, help="name of the bank entry (letters, digits, ._-)")
    _repeat_arguments(profile, runs=3, why="after the grid, to state the measurement noise in the entry")
    profile.set_defaults(run=_tune, max_memory_mib=None, front_out=None)  # a profile records every trial as is

    evaluate = commands.add_parser("evaluate", help="replay searchers on a profile bank (leave-one-model-out)")
    evaluate.add_argument("--bank", required=True, help="profile bank directory (one JSON file per model)")
    evaluate.add_argument("--searchers", default="random,tpe,gp,meta,best-on-average,prior-only,tpe-warm",
                          help="comma-separated searcher names")
    evaluate.add_argument("--seeds", type=int, default=5, help="runs per searcher and held-out model")
    evaluate.add_argument("--budget", type=int, default=None, help="trials per run (default: the whole space)")
    evaluate.add_argument("--tolerance", type=float, default=0.05, help="'near the optimum' as a fraction")
    evaluate.add_argument("--plot", default="autoconfig_replay.png", help="PNG of the search progress")
    evaluate.set_defaults(run=_evaluate)

    report = commands.add_parser("report", help="a study's (or a bank entry's) trials, search progress and surface")
    source = report.add_mutually_exclusive_group(required=True)
    source.add_argument("--study", help="name of a study in --storage")
    source.add_argument("--bank-entry", help="a profile-bank JSON file instead of a study")
    report.add_argument("--storage", default="sqlite:///autoconfig.db", help="Optuna storage URL of the study")
    report.add_argument("--plot", default="autoconfig_report.png", help="PNG of the progress and the surface")
    report.set_defaults(run=_report)

    plan = commands.add_parser("plan", help="size pools, place them on a node list and report what is stranded "
                               "(docs/AUTOCONFIG.md, 'Planning a cluster')")
    plan.add_argument("--services", required=True, help="a service file (YAML or JSON: pools measured by `profile`, "
                      "per layout) or a trace CSV in the format of Prism's disaggregated_DLRM_trace.csv")
    plan.add_argument("--nodes", required=True, help="the node list: CSV in the openb format (sn, cpu_milli, "
                      "memory_mib, gpu, model) or YAML/JSON {nodes: [{name, cpus, memory_gib, gpus, count}]}")
    plan.add_argument("--layout", choices=("monolithic", "disaggregated"), required=True,
                      help="monolithic: a trace's GPU-node instances fused with their service's CPU-node share")
    plan.add_argument("--policy", choices=("best-fit", "fgd", "fgd-reserve"), default="fgd-reserve",
                      help="best-fit (baseline); fgd: fragmentation gradient descent (ATC'23) over CPUs, memory "
                           "and GPUs; fgd-reserve: fgd keeping GPU nodes' CPUs and memory for GPU instances")
    plan.add_argument("--moment", default="busiest", help="trace only: the instances alive at the busiest moment, "
                      "at a time in seconds, or all")
    plan.add_argument("--out", default="plan.json", help="the plan as JSON: pools, every instance's node, what "
                      "could not be placed and why, fragmentation")
    plan.add_argument("--template", default="deploy/serve_config.gpu.yaml",
                      help="Serve config whose DLRM apps the services name (services[i].app)")
    plan.add_argument("--serve-config", default=None, help="write the Serve config that realises the plan here")
    plan.add_argument("--worker-groups", default=None, help="write KubeRay workerGroupSpecs for the plan's nodes here")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args, Console())


if __name__ == "__main__":
    sys.exit(main())
