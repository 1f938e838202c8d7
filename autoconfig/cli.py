"""The ``autoconfig`` command line: ``check``, ``tune``, ``profile``, ``evaluate``, ``report`` and ``plan``.

Each subcommand's ``--help`` says what it does (docs/AUTOCONFIG.md: how trials and studies work). ``main`` returns
the exit code; ``tune`` stopped by Ctrl-C or SIGTERM keeps its finished trials and returns 130 or 143.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from autoconfig import __version__

if TYPE_CHECKING:
    from autoconfig.searchers.base import Observation
    from autoconfig.space import Configuration
    from autoconfig.study import TuningStudy

#: ``tune --searcher`` choices (``autoconfig.searchers.SEARCHERS``, named here so ``--help`` needs no import of it).
SEARCHER_NAMES = ("grid", "random", "tpe", "gp", "meta", "rgpe", "best-on-average", "prior-only", "tpe-warm",
                  "pareto")
BANK_SEARCHERS = frozenset({"meta", "rgpe", "best-on-average", "prior-only", "tpe-warm"})
#: Applications with shortcut knobs, a shipped space and a built-in workload: import path -> space name.
BUILT_IN_KINDS = {"disagg.app:build_app": "dlrm", "serving.app:build_app": "diffusion",
                  "serving.app:build_multi_app": "diffusion"}


def _is_workload_file(value: str) -> bool:
    """``--workload`` names a JSONL file (``*.jsonl`` or an existing file) rather than KEY=VALUE options."""
    return value.endswith(".jsonl") or Path(value).is_file()


def _check(args: argparse.Namespace, console: Console) -> int:
    from autoconfig.serve_config import ServeConfigError, check_models, load_serve_config

    try:
        config = load_serve_config(args.config)
        reports = check_models(config, source=str(args.config))
    except ServeConfigError as exc:
        console.print(f"[red]invalid:[/red] {exc}", soft_wrap=True)
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
    import ray
    from pydantic import ValidationError
    from ray import serve
    from rich.progress import Progress

    from autoconfig.bank import ModelDescription, load_bank
    from autoconfig.knobs import check_space, configure_serve_config, write_serve_config
    from autoconfig.pareto import Limits
    from autoconfig.searchers import SEARCHERS, GridSearcher
    from autoconfig.serve_config import ServeConfigError, load_serve_config
    from autoconfig.space import SearchSpace, SpaceError, describe_validation_error
    from autoconfig.stress import SearchSettings
    from autoconfig.study import StudyError, TuningStudy
    from autoconfig.trial import TRIAL_APP_NAME, delete_trial_app, run_trial
    from autoconfig.tuner import remeasured_while_interfered, repeat_best, tune, unconfirmed
    from autoconfig.workloads import load_workload_file, parse_workload_options, workload_for_app

    try:
        template = load_serve_config(args.config)
        app = next((app for app in template.applications if app.name == args.app), None)
        if app is None:
            names = ", ".join(app.name for app in template.applications)
            raise ServeConfigError(f"{args.config}: no application {args.app!r}; applications: {names}")
        kind = BUILT_IN_KINDS.get(app.import_path)
        workload_file = args.workload is not None and _is_workload_file(args.workload)
        if kind is None and not (args.space and workload_file):
            raise ValueError(f"application {args.app!r} ({app.import_path}) is not a built-in app: give --space "
                             "FILE.yaml (its knobs as dotted paths) and --workload FILE.jsonl (its requests)")
        if args.space is None:
            space = SearchSpace.default(kind)
        else:  # a file, or the name of a shipped space (dlrm-joint...)
            space = SearchSpace.from_yaml(args.space) if Path(args.space).is_file() else SearchSpace.default(args.space)
        try:
            check_space(template, args.app, space, accelerator=args.accelerator)
        except SpaceError as error:
            raise SpaceError(f"{args.space or kind + ' space'}: {error}") from None
        profiling = args.command == "profile"  # the whole grid, recorded as a bank entry
        if args.repeat_best < 0 or args.repeats < 1:
            raise ValueError(f"--repeat-best must be >= 0 and --repeats >= 1, got {args.repeat_best} and "
                             f"{args.repeats}")
        if args.repeat_limit is None:
            args.repeat_limit = 2 * args.repeat_best
        if args.max_interference is not None and not 0.0 < args.max_interference <= 1.0:
            raise ValueError(f"--max-interference must be in (0, 1], got {args.max_interference}")
        if args.interference_retries < 0:
            raise ValueError(f"--interference-retries must be >= 0, got {args.interference_retries}")
        if args.repeat_limit < args.repeat_best:
            raise ValueError(f"--repeat-limit must be >= --repeat-best ({args.repeat_best}), got {args.repeat_limit}")
        if profiling:
            ModelDescription(name=args.model_name)  # a bad name is refused now, not after the last trial
            args.searcher, args.budget, args.seed = "grid", space.size, 0
        study = TuningStudy.open(args.storage, args.study or f"{args.app}-{args.searcher}", space)
        prior = load_bank(args.bank) if args.bank and not profiling else []
        if workload_file:
            workload, workload_description = load_workload_file(args.workload), {"file": str(args.workload)}
        else:
            workload_description = parse_workload_options(args.workload)
            workload = workload_for_app(app.import_path, app.args, workload_description)
        # What was tuned, as a bank entry records it: the bank's searchers weigh alike models more.
        description = {"app": args.app, "args": app.args, "workload": workload_description,
                       "slo_p99_ms": args.slo_p99_ms}
        settings = SearchSettings(probe_s=args.probe_s, start_rps=args.start_rps, max_probes=args.max_probes,
                                  rel_tolerance=args.tolerance, min_requests=args.min_requests)
        limits = Limits(max_memory_mib=args.max_memory_mib)
    except ValidationError as error:  # the rate search's options, named as SearchSettings fields
        console.print(f"[red]error:[/red] {describe_validation_error(error)}", soft_wrap=True)
        return 2
    except (ServeConfigError, SpaceError, StudyError, ValueError) as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        return 2
    if args.searcher in BANK_SEARCHERS and not prior:
        console.print(f"[red]error:[/red] --searcher {args.searcher} needs --bank DIR (profiles of other models to "
                      "learn from)", soft_wrap=True)
        return 2
    # A profile walks the grid in deployment order: the kept trial app restarts replicas a few times per grid.
    try:
        searcher = (GridSearcher(space, order="deployment") if profiling
                    else SEARCHERS[args.searcher](space, args.seed, prior, target=description))
    except ValueError as error:  # a bank with no profile over this space's knobs
        console.print(f"[red]error:[/red] --searcher {args.searcher}: {error}", soft_wrap=True)
        return 2
    if args.accelerator == "cpu":
        from serving.common.cpu_share import CgroupCpu, CpuShareError

        try:
            CgroupCpu.find()
        except CpuShareError as error:  # replicas on other nodes may still enforce theirs; they log if not
            console.print(f"[yellow]warning:[/yellow] device_share is only reserved on this node, not enforced "
                          f"({error})")
    done = len(study.history())
    console.print(f"study {study.name!r} in {args.storage}: {done} finished trial(s), budget {args.budget}, "
                  f"space of {space.size} configurations, searcher {args.searcher}")
    _warn_other_machines(console, study)
    owns_cluster = not ray.is_initialized() and args.address is None  # a local cluster of our own: ours to stop
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False)
    confirmed = None  # tune's best configuration by the mean of its repeated runs
    try:
        with _sigterm_as_interrupt(), Progress(console=console) as progress:
            bar = progress.add_task("profiling", total=args.budget, completed=min(done, args.budget))

            def measure(config):
                progress.update(bar, description=f"profiling {config.as_dict()}")
                return run_trial(template, args.app, config.as_dict(), workload, args.slo_p99_ms,
                                 warmup_s=args.warmup_s, search=settings, objective=args.objective,
                                 accelerator=args.accelerator, teardown=args.fresh_deploy)

            def set_aside(config, attempt, record):
                progress.console.print(f"measuring {config.as_dict()} again ({attempt}/{args.interference_retries})"
                                       f": {record.sustainable_rps:.1f} rps with "
                                       f"{record.interference.describe()}")

            profile = measure if args.max_interference is None else remeasured_while_interfered(
                measure, limit=args.max_interference, retries=args.interference_retries, on_retry=set_aside)

            def report(number, config, record):
                progress.advance(bar)
                progress.console.print(f"trial {number}: {config.as_dict()} -> {_outcome(record)}")

            outcome = tune(study, searcher, profile, budget=args.budget, limits=limits, on_trial=report)
            complete = len(outcome.history) == space.size if profiling else outcome.best is not None
            if complete and args.repeats > 1 and args.repeat_best > 0:
                progress.update(bar, total=args.budget + args.repeat_limit * (args.repeats - 1))  # at most

                def repeated(config, run, record):
                    progress.advance(bar)
                    progress.console.print(f"repeat {run}/{args.repeats}: {config.as_dict()} -> {_outcome(record)}")

                measured = repeat_best(study, profile, configs=args.repeat_best, runs=args.repeats,
                                       limit=args.repeat_limit, on_repeat=repeated)
                progress.update(bar, total=progress.tasks[bar].completed)
                for config in unconfirmed(study, configs=args.repeat_best, runs=args.repeats):
                    progress.console.print(f"[yellow]warning:[/yellow] {config.as_dict()} ranks among the "
                                           f"{args.repeat_best} best on fewer than {args.repeats} runs: "
                                           f"--repeat-limit {args.repeat_limit} reached")
                if not profiling:
                    confirmed = _print_confirmation(console, measured, outcome.best)
    except KeyboardInterrupt as stop:  # the trial in progress is dropped; the finished ones are stored
        console.print(f"[yellow]stopped:[/yellow] study {study.name!r} in {args.storage} keeps its "
                      f"{len(study.history())} finished trial(s); run the same command to resume")
        return 143 if isinstance(stop, _Terminated) else 130
    finally:
        delete_trial_app(TRIAL_APP_NAME)  # kept between trials unless --fresh-deploy
        if owns_cluster:  # on a shared cluster Serve keeps running
            serve.shutdown()
            ray.shutdown()
    _print_trials(console, study.records())
    _warn_interference(console, study)
    if profiling:
        if len(outcome.history) < space.size:
            console.print(f"[red]{len(outcome.history)} of {space.size} configurations profiled[/red]")
            return 1
        entry = study.to_bank_entry({"name": args.model_name, **description}, _machine(), args.objective)
        path = Path(args.bank) / f"{args.model_name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        entry.save(path)
        for repeat in entry.repeats:
            console.print(f"noise: {repeat.config.as_dict()} objectives {repeat.objectives}")
        noise = entry.noise()
        console.print(f"[green]profiled[/green] {space.size} configurations; wrote {path}"
                      + ("" if noise is None else f"; measurement noise (median std/mean of {len(entry.repeats)} "
                         f"repeated configurations): {noise:.1%}"))
        return 0
    front = _print_front(console, study.records())  # the trials over a limit carry their violation
    if args.front_out:
        Path(args.front_out).write_text(json.dumps(front, indent=1) + "\n")
        console.print(f"wrote the Pareto front to {args.front_out}")
    if outcome.best is None:
        closest = min(study.records(), key=lambda r: r.get("p99_ms") or float("inf"), default=None)
        console.print(f"[red]no configuration met the p99 SLO of {args.slo_p99_ms:g} ms[/red]"
                      + (f"; the lowest p99 seen was {closest['p99_ms']:.1f} ms at {closest['config']}"
                         if closest and closest.get("p99_ms") else ""))
        return 1
    best, measure = outcome.best, "objective"
    if confirmed is not None:
        best, measure = confirmed, f"mean objective over {len(measured[confirmed.config])} runs"
    tuned = configure_serve_config(template, args.app, best.config.as_dict(), accelerator=args.accelerator)
    write_serve_config(tuned, args.out)
    console.print(f"[green]best:[/green] {best.config.as_dict()} ({measure} {best.value:.2f}); "
                  f"wrote {args.out} (deploy with `serve deploy {args.out}`)")
    return 0


def _print_confirmation(console: Console, measured: dict[Configuration, list[float | None]],
                        single_best: Observation) -> Observation | None:
    """Print each repeated configuration's runs and mean; return ``confirmed_best`` of them."""
    from autoconfig.bank import mean_of_runs
    from autoconfig.tuner import confirmed_best

    table = Table(title="the best configurations, measured again (a run that held no rate counts 0)")
    for column in ("configuration", "objectives", "mean"):
        table.add_column(column)
    for config, runs in measured.items():
        table.add_row(str(config.as_dict()), ", ".join("-" if v is None else f"{v:.2f}" for v in runs),
                      f"{mean_of_runs(runs):.2f}")
    console.print(table)
    confirmed = confirmed_best(measured)
    if confirmed is not None and confirmed.config != single_best.config:
        console.print(f"the best single run ({single_best.config.as_dict()}, {single_best.value:.2f}) did not hold "
                      f"up: {confirmed.config.as_dict()} has the best mean")
    return confirmed


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises ``KeyboardInterrupt`` (no ``except Exception`` in a trial catches it)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While trials run, SIGTERM stops ``tune`` as Ctrl-C does: the trial app is deleted, the study kept."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _machine() -> dict[str, object]:
    """Where a profile was measured."""
    import os
    import platform

    import torch

    from autoconfig.provenance import cpu_model

    return {"cpu": cpu_model(), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "python": platform.python_version()}


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
    _print_trials(console, records)
    best = best_observation(history)
    if best is None:
        console.print(f"{len(history)} trials; [red]none met the SLO[/red]")
    else:
        console.print(f"{len(history)} trials of {space.size}; best {best.config.as_dict()} "
                      f"({objective} {best.value:.2f}, found at trial {history.index(best) + 1})")
    _print_front(console, records)
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


def _outcome(record) -> str:
    """A trial's status, rate (offered, and achieved when measured) and objective, for its progress line; what
    the rate search lost to other work where that was noticeable."""
    from autoconfig.interference import NOTICEABLE

    achieved = "" if record.achieved_rps is None else f" ({record.achieved_rps:.1f} achieved)"
    line = f"{record.status}, {record.sustainable_rps:.1f} rps{achieved}, objective {record.objective:.2f}"
    lost = record.interference
    return line + (f" [yellow]({lost.describe()})[/yellow]" if lost and lost.lost >= NOTICEABLE else "")


def _warn_interference(console: Console, study: TuningStudy) -> None:
    """Warn about the trials and repeat runs whose rate search lost a noticeable share of the node's CPUs."""
    from autoconfig.interference import NOTICEABLE, Interference

    def lost(run: dict) -> float:
        return Interference.model_validate(run["interference"]).lost if run.get("interference") else 0.0

    trials = [number for number, record in enumerate(study.records(), 1) if lost(record) >= NOTICEABLE]
    runs = sum(lost(run) >= NOTICEABLE for runs in study.repeats().values() for run in runs)
    if trials or runs:
        console.print(f"[yellow]warning:[/yellow] {len(trials)} trial(s) ({', '.join(map(str, trials)) or '-'}) "
                      f"and {runs} repeat run(s) lost {NOTICEABLE:.0%} or more of the node's CPUs to the "
                      "hypervisor or to other processes while measured: their rates understate the configurations'; "
                      "measure them again on a quiet node")


def _warn_other_machines(console: Console, study: TuningStudy) -> None:
    """Warns when a resumed study holds measurements taken on other hardware than this machine: its rates are
    another system's, and mixing them with this machine's misleads the search and the bank."""
    from autoconfig.provenance import machine_id

    runs = [*study.records(), *(run for runs in study.repeats().values() for run in runs)]
    elsewhere = Counter(run["machine"] for run in runs if run.get("machine") not in (None, machine_id()))
    if elsewhere:
        named = ", ".join(f"{count} on {machine}" for machine, count in elsewhere.items())
        console.print(f"[yellow]warning:[/yellow] study {study.name!r} holds measurements taken on other hardware "
                      f"({named}); this machine is {machine_id()}. Rates from different machines are not "
                      "comparable: use a new --study to profile this machine alone", soft_wrap=True)


def _print_front(console: Console, records: list[dict]) -> list[dict]:
    """Print the Pareto front of ``records`` (objective up, p99 and memory down, within the limits the study
    applied) and return it, best objective first."""
    from autoconfig.pareto import front_metrics, pareto_front

    front = [records[i] for i in pareto_front(records)]
    metrics = front_metrics(records)
    table = Table(title=f"Pareto front ({', '.join(metrics)})")
    for column in ("configuration", *metrics):
        table.add_column(column)
    for record in front:
        table.add_row(str(record["config"]), *(f"{record[name]:.2f}" for name in metrics))
    if front:
        console.print(table)
    return [{"config": record["config"], **{name: record[name] for name in metrics}} for record in front]


def _print_trials(console: Console, records: list[dict]) -> None:
    table = Table(title="trials")
    for column in ("#", "configuration", "status", "rps", "achieved rps", "p99 ms", "objective"):
        table.add_column(column)
    for number, record in enumerate(records, start=1):
        p99, achieved = record.get("p99_ms"), record.get("achieved_rps")
        table.add_row(str(number), str(record["config"]), str(record.get("status")),
                      f"{record.get('sustainable_rps', 0):.1f}", "-" if achieved is None else f"{achieved:.1f}",
                      "-" if p99 is None else f"{p99:.1f}", f"{record.get('objective', 0):.2f}")
    console.print(table)


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
                             "diffusion steps, size, n (default: one small request of the app's model)")
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
