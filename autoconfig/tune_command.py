"""What ``autoconfig tune`` and ``profile`` do, step by step: read and check every input before any trial, settle
what a GPU share divides, measure the application's own configuration, search, measure the best again, and write
the tuned Serve config (``tune``) or the bank entry (``profile``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from autoconfig import trial
from autoconfig.bank import BankEntry, ModelDescription, load_bank
from autoconfig.gpu_share import GpuShareError, GpuShareMode, gpu_nodes_without_mps, resolve_gpu_share_mode
from autoconfig.interference import NOTICEABLE, Interference
from autoconfig.knobs import check_space, configure_serve_config, write_serve_config
from autoconfig.pareto import Limits, front_metrics, pareto_front
from autoconfig.provenance import machine_id
from autoconfig.searchers import SEARCHERS, GridSearcher
from autoconfig.searchers.base import Observation, Searcher
from autoconfig.serve_config import ServeConfigError, load_serve_config
from autoconfig.space import Configuration, SearchSpace, SpaceError, describe_validation_error
from autoconfig.stress import SearchSettings
from autoconfig.study import StudyError, TuningStudy
from autoconfig.tuner import (
    TuneOutcome,
    best_observation,
    confirmed_best,
    remeasured_while_interfered,
    repeat_best,
    tune,
    unconfirmed,
)
from autoconfig.workloads import RequestSource, load_workload_file, parse_workload_options, workload_for_app

BANK_SEARCHERS = frozenset({"meta", "rgpe", "best-on-average", "prior-only", "tpe-warm"})
#: Applications with shortcut knobs, a shipped space and a built-in workload: import path -> space name.
BUILT_IN_KINDS = {"disagg.app:build_app": "dlrm", "serving.app:build_app": "diffusion",
                  "serving.app:build_multi_app": "diffusion"}
#: Inputs refused (exit code 2) before any trial.
INPUT_ERRORS = (ServeConfigError, SpaceError, StudyError, GpuShareError, ValueError)


@dataclass(frozen=True)
class TuneInputs:
    """Everything a run needs, read and checked before any trial."""

    template: ServeDeploySchema
    space: SearchSpace
    study: TuningStudy
    prior: list[BankEntry]
    workload: RequestSource
    description: dict[str, Any]  # what was tuned, as a bank entry records it
    settings: SearchSettings
    limits: Limits
    profiling: bool


@dataclass(frozen=True)
class Searched:
    """What the trials found: the search's outcome, the application's own configuration as measured (its trial
    record's fields, None if not measured), and the best by repeated runs (None without repeats)."""

    outcome: TuneOutcome
    starting: dict[str, Any] | None
    measured: dict[Configuration, list[float | None]]
    confirmed: Observation | None


def run_tune(args: argparse.Namespace, console: Console) -> int:
    """``tune`` or ``profile`` (``args.command``); the exit code."""
    started = time.monotonic()
    try:
        inputs = read_inputs(args)
        searcher = make_searcher(args, inputs)
    except ValidationError as error:  # the rate search's options, named as SearchSettings fields
        console.print(f"[red]error:[/red] {describe_validation_error(error)}", soft_wrap=True)
        return 2
    except INPUT_ERRORS as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        return 2
    if args.accelerator == "cpu":
        _warn_unenforced_cpu_share(console)
    console.print(f"study {inputs.study.name!r} in {args.storage}: {len(inputs.study.history())} finished trial(s), "
                  f"budget {args.budget}, space of {inputs.space.size} configurations, searcher {args.searcher}")
    _warn_other_machines(console, inputs.study)
    owns_cluster = not ray.is_initialized() and args.address is None  # a local cluster of our own: ours to stop
    if not ray.is_initialized():
        ray.init(address=args.address, include_dashboard=False)
    try:
        gpu_share_mode = settle_gpu_share_mode(args, console)
        with _sigterm_as_interrupt():
            searched = search(args, inputs, searcher, gpu_share_mode, console)
    except GpuShareError as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        return 2
    except KeyboardInterrupt as stop:  # the trial in progress is dropped; the finished ones are stored
        console.print(f"[yellow]stopped:[/yellow] study {inputs.study.name!r} in {args.storage} keeps its "
                      f"{len(inputs.study.history())} finished trial(s); run the same command to resume")
        return 143 if isinstance(stop, _Terminated) else 130
    finally:
        trial.delete_trial_app(trial.TRIAL_APP_NAME)  # kept between trials unless --fresh-deploy
        if owns_cluster:  # on a shared cluster Serve keeps running
            serve.shutdown()
            ray.shutdown()
    print_trials(console, inputs.study.records())
    _warn_interference(console, inputs.study)
    if inputs.profiling:
        return write_profile(args, inputs, searched, console)
    return write_tuned(args, inputs, searched, gpu_share_mode, console, time.monotonic() - started)


def read_inputs(args: argparse.Namespace) -> TuneInputs:
    """The template, space, study, bank and workload the command line names, each checked (``INPUT_ERRORS``, or a
    pydantic ValidationError for the rate search's options); ``profile`` sets its grid's searcher and budget."""
    _check_options(args)
    template = load_serve_config(args.config)
    app = next((app for app in template.applications if app.name == args.app), None)
    if app is None:
        names = ", ".join(app.name for app in template.applications)
        raise ServeConfigError(f"{args.config}: no application {args.app!r}; applications: {names}")
    kind = BUILT_IN_KINDS.get(app.import_path)
    workload_file = args.workload is not None and is_workload_file(args.workload)
    if kind is None and not (args.space and workload_file):
        raise ValueError(f"application {args.app!r} ({app.import_path}) is not a built-in app: give --space "
                         "FILE.yaml (its knobs as dotted paths) and --workload FILE.jsonl (its requests)")
    if args.space is None:
        space = SearchSpace.default(kind)
    else:  # a file, or the name of a shipped space (dlrm-joint...)
        space = SearchSpace.from_yaml(args.space) if Path(args.space).is_file() else SearchSpace.default(args.space)
    try:  # the mode changes only environment variables: any mode checks the same
        check_space(template, args.app, space, accelerator=args.accelerator,
                    gpu_share_mode=args.gpu_share_mode or "memory")
    except SpaceError as error:
        raise SpaceError(f"{args.space or kind + ' space'}: {error}") from None
    profiling = args.command == "profile"  # the whole grid, recorded as a bank entry
    if profiling:
        ModelDescription(name=args.model_name)  # a bad name is refused now, not after the last trial
        args.searcher, args.budget, args.seed = "grid", space.size, 0
    study = TuningStudy.open(args.storage, args.study or f"{args.app}-{args.searcher}", space)
    prior = load_bank(args.bank) if args.bank and not profiling else []
    workload, workload_description = _workload(args, app, workload_file)
    return TuneInputs(
        template=template, space=space, study=study, prior=prior, workload=workload,
        description={"app": args.app, "args": app.args, "workload": workload_description,
                     "slo_p99_ms": args.slo_p99_ms},
        settings=SearchSettings(probe_s=args.probe_s, start_rps=args.start_rps, max_probes=args.max_probes,
                                rel_tolerance=args.tolerance, min_requests=args.min_requests),
        limits=Limits(max_memory_mib=args.max_memory_mib), profiling=profiling)


def is_workload_file(value: str) -> bool:
    """``--workload`` names a JSONL file (``*.jsonl`` or an existing file) rather than KEY=VALUE options."""
    return value.endswith(".jsonl") or Path(value).is_file()


def _check_options(args: argparse.Namespace) -> None:
    if args.repeat_best < 0 or args.repeats < 1:
        raise ValueError(f"--repeat-best must be >= 0 and --repeats >= 1, got {args.repeat_best} and {args.repeats}")
    if args.repeat_limit is None:
        args.repeat_limit = 2 * args.repeat_best
    if args.max_interference is not None and not 0.0 < args.max_interference <= 1.0:
        raise ValueError(f"--max-interference must be in (0, 1], got {args.max_interference}")
    if args.interference_retries < 0:
        raise ValueError(f"--interference-retries must be >= 0, got {args.interference_retries}")
    if args.repeat_limit < args.repeat_best:
        raise ValueError(f"--repeat-limit must be >= --repeat-best ({args.repeat_best}), got {args.repeat_limit}")
    if args.gpu_share_mode is not None and args.accelerator != "gpu":
        raise ValueError(f"--gpu-share-mode {args.gpu_share_mode}: GPU shares need --accelerator gpu")


def _workload(args: argparse.Namespace, app: ServeApplicationSchema,
              workload_file: bool) -> tuple[RequestSource, dict[str, Any]]:
    if workload_file:
        return load_workload_file(args.workload), {"file": str(args.workload)}
    description = parse_workload_options(args.workload)
    return workload_for_app(app.import_path, app.args, description), description


def make_searcher(args: argparse.Namespace, inputs: TuneInputs) -> Searcher:
    """The searcher ``--searcher`` names (``profile``: the grid in deployment order, so the kept trial app restarts
    replicas a few times per grid); ValueError for a bank searcher without a bank it can use."""
    if inputs.profiling:
        return GridSearcher(inputs.space, order="deployment")
    if args.searcher in BANK_SEARCHERS and not inputs.prior:
        raise ValueError(f"--searcher {args.searcher} needs --bank DIR (profiles of other models to learn from)")
    try:
        return SEARCHERS[args.searcher](inputs.space, args.seed, inputs.prior, target=inputs.description)
    except ValueError as error:  # a bank with no profile over this space's knobs
        raise ValueError(f"--searcher {args.searcher}: {error}") from None


def settle_gpu_share_mode(args: argparse.Namespace, console: Console) -> GpuShareMode:
    """What a GPU share divides in this run's trials and written config (``memory`` on CPU, where it is unused);
    GpuShareError when ``mps`` is asked for where a GPU node's daemon does not answer."""
    if args.accelerator != "gpu":
        return "memory"
    mode, warning = resolve_gpu_share_mode(args.gpu_share_mode, gpu_nodes_without_mps)
    if warning is not None:
        console.print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True)
    console.print(f"GPU shares: {mode}")
    return mode


def search(args: argparse.Namespace, inputs: TuneInputs, searcher: Searcher, gpu_share_mode: GpuShareMode,
           console: Console) -> Searched:
    """The trials: the application's own configuration first (once per study), the searcher's until the study
    holds the budget, then the best measured again (``--repeat-best``, ``--repeats``)."""
    study = inputs.study
    with Progress(console=console) as progress:
        bar = progress.add_task("profiling", total=args.budget, completed=min(len(study.history()), args.budget))

        def measure(configuration: Mapping[str, Any]) -> trial.TrialRecord:
            progress.update(bar, description=f"profiling {dict(configuration) or 'the app as configured'}")
            return trial.run_trial(inputs.template, args.app, configuration, inputs.workload, args.slo_p99_ms,
                                   warmup_s=args.warmup_s, search=inputs.settings, objective=args.objective,
                                   accelerator=args.accelerator, gpu_share_mode=gpu_share_mode,
                                   teardown=args.fresh_deploy)

        starting = _measure_starting_point(study, measure, progress.console)
        profile = _interference_checked(args, lambda config: measure(config.as_dict()), progress.console)

        def report(number: int, config: Configuration, record: trial.TrialRecord) -> None:
            progress.advance(bar)
            progress.console.print(f"trial {number}: {config.as_dict()} -> {_outcome(record)}")

        outcome = tune(study, searcher, profile, budget=args.budget, limits=inputs.limits, on_trial=report)
        complete = len(outcome.history) == inputs.space.size if inputs.profiling else outcome.best is not None
        measured: dict[Configuration, list[float | None]] = {}
        confirmed = None
        if complete and args.repeats > 1 and args.repeat_best > 0:
            progress.update(bar, total=args.budget + args.repeat_limit * (args.repeats - 1))  # at most

            def repeated(config: Configuration, run: int, record: trial.TrialRecord) -> None:
                progress.advance(bar)
                progress.console.print(f"repeat {run}/{args.repeats}: {config.as_dict()} -> {_outcome(record)}")

            measured = repeat_best(study, profile, configs=args.repeat_best, runs=args.repeats,
                                   limit=args.repeat_limit, on_repeat=repeated)
            progress.update(bar, total=progress.tasks[bar].completed)
            for config in unconfirmed(study, configs=args.repeat_best, runs=args.repeats):
                progress.console.print(f"[yellow]warning:[/yellow] {config.as_dict()} ranks among the "
                                       f"{args.repeat_best} best on fewer than {args.repeats} runs: "
                                       f"--repeat-limit {args.repeat_limit} reached")
            if not inputs.profiling:
                confirmed = _print_confirmation(console, measured, outcome.best)
    return Searched(outcome, starting, measured, confirmed)


def _measure_starting_point(study: TuningStudy, measure: Callable[[Mapping[str, Any]], trial.TrialRecord],
                            console: Console) -> dict[str, Any]:
    """The application as its Serve config has it (no knob applied), measured once per study: what tuning gains
    over. A study that already holds trials (measured in another session, maybe on a busier machine) gets its best
    so far measured again right after it (``reference_config``, ``reference_objective``), so that the two compare."""
    starting = study.starting_point()
    if starting is None:
        best = _best_so_far(study)
        record = measure({})
        starting = record.model_dump(exclude={"search", "configuration"})
        console.print(f"the app as configured -> {_outcome(record)}")
        if best is not None:
            again = measure(best.as_dict())
            starting |= {"reference_config": best.as_dict(),
                         "reference_objective": again.objective if again.status == "ok" else None}
            console.print(f"its best so far measured again beside it: {best.as_dict()} -> {_outcome(again)}")
        study.record_starting_point(starting)
    return starting


def _best_so_far(study: TuningStudy) -> Configuration | None:
    """The study's best configuration (by the mean of its runs where it was raced), or None without one."""
    confirmed = confirmed_best(study.repeated_objectives())
    best = confirmed or best_observation(study.history())
    return None if best is None else best.config


def _interference_checked(args: argparse.Namespace, measure: Callable[[Configuration], trial.TrialRecord],
                          console: Console) -> Callable[[Configuration], trial.TrialRecord]:
    """``measure``, or with ``--max-interference`` one that measures again a run that lost that much of the node."""
    if args.max_interference is None:
        return measure

    def set_aside(config: Configuration, attempt: int, record: trial.TrialRecord) -> None:
        console.print(f"measuring {config.as_dict()} again ({attempt}/{args.interference_retries}): "
                      f"{record.sustainable_rps:.1f} rps with {record.interference.describe()}")

    return remeasured_while_interfered(measure, limit=args.max_interference, retries=args.interference_retries,
                                       on_retry=set_aside)


def write_profile(args: argparse.Namespace, inputs: TuneInputs, searched: Searched, console: Console) -> int:
    """``profile``'s end: the bank entry written when the whole grid was measured (exit 0), else exit 1."""
    study, size = inputs.study, inputs.space.size
    if len(searched.outcome.history) < size:
        console.print(f"[red]{len(searched.outcome.history)} of {size} configurations profiled[/red]")
        return 1
    entry = study.to_bank_entry({"name": args.model_name, **inputs.description}, _machine(), args.objective)
    path = Path(args.bank) / f"{args.model_name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry.save(path)
    for repeat in entry.repeats:
        console.print(f"noise: {repeat.config.as_dict()} objectives {repeat.objectives}")
    noise = entry.noise()
    console.print(f"[green]profiled[/green] {size} configurations; wrote {path}"
                  + ("" if noise is None else f"; measurement noise (median std/mean of {len(entry.repeats)} "
                     f"repeated configurations): {noise:.1%}"))
    return 0


def write_tuned(args: argparse.Namespace, inputs: TuneInputs, searched: Searched, gpu_share_mode: GpuShareMode,
                console: Console, wall_s: float) -> int:
    """``tune``'s end: the Pareto front, the best configuration's Serve config written and its gain over the app's
    own configuration (exit 0), or exit 1 when none met the SLO."""
    study = inputs.study
    front = print_front(console, study.records())  # the trials over a limit carry their violation
    if args.front_out:
        Path(args.front_out).write_text(json.dumps(front, indent=1) + "\n")
        console.print(f"wrote the Pareto front to {args.front_out}")
    outcome = searched.outcome
    if outcome.best is None:
        closest = min(study.records(), key=lambda r: r.get("p99_ms") or float("inf"), default=None)
        console.print(f"[red]no configuration met the p99 SLO of {args.slo_p99_ms:g} ms[/red]"
                      + (f"; the lowest p99 seen was {closest['p99_ms']:.1f} ms at {closest['config']}"
                         if closest and closest.get("p99_ms") else ""))
        return 1
    best, measure = outcome.best, "objective"
    if searched.confirmed is not None:
        best = searched.confirmed
        measure = f"mean objective over {len(searched.measured[best.config])} runs"
    tuned = configure_serve_config(inputs.template, args.app, best.config.as_dict(), accelerator=args.accelerator,
                                   gpu_share_mode=gpu_share_mode)
    write_serve_config(tuned, args.out)
    console.print(f"[green]best:[/green] {best.config.as_dict()} ({measure} {best.value:.2f}); "
                  f"wrote {args.out} (deploy with `serve deploy {args.out}`)")
    console.print(gain_line(best.value, searched.starting, study, wall_s), soft_wrap=True)
    return 0


def gain_line(tuned: float, starting: Mapping[str, Any] | None, study: TuningStudy, wall_s: float) -> str:
    """Tuned against the app's own configuration, and the time tuning took (this run; every stored trial)."""
    trials_s = sum(record.get("duration_s") or 0.0 for record in study.records())
    took = f"tuning took {wall_s / 60:.1f} min (the study's trials {trials_s / 60:.1f} min in all)"
    if starting is None:
        return f"{took}; the app as configured was not measured"
    if starting.get("status") != "ok" or not starting.get("objective"):
        why = starting.get("error") or f"status {starting.get('status')}"
        return f"{took}; the app as configured held no rate within the SLO ({why}): no gain to state"
    return (f"tuned objective {tuned:.2f} against {starting['objective']:.2f} for the app as configured: "
            f"{tuned / starting['objective']:.2f}x; {took}")


def _print_confirmation(console: Console, measured: dict[Configuration, list[float | None]],
                        single_best: Observation | None) -> Observation | None:
    """Print each repeated configuration's runs and mean; return ``confirmed_best`` of them."""
    from autoconfig.bank import mean_of_runs

    table = Table(title="the best configurations, measured again (a run that held no rate counts 0)")
    for column in ("configuration", "objectives", "mean"):
        table.add_column(column)
    for config, runs in measured.items():
        table.add_row(str(config.as_dict()), ", ".join("-" if v is None else f"{v:.2f}" for v in runs),
                      f"{mean_of_runs(runs):.2f}")
    console.print(table)
    confirmed = confirmed_best(measured)
    if confirmed is not None and single_best is not None and confirmed.config != single_best.config:
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
    import torch

    from autoconfig.provenance import cpu_model

    return {"cpu": cpu_model(), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "python": platform.python_version()}


def _warn_unenforced_cpu_share(console: Console) -> None:
    from serving.common.cpu_share import CgroupCpu, CpuShareError

    try:
        CgroupCpu.find()
    except CpuShareError as error:  # replicas on other nodes may still enforce theirs; they log if not
        console.print(f"[yellow]warning:[/yellow] device_share is only reserved on this node, not enforced "
                      f"({error})")


def _outcome(record: trial.TrialRecord) -> str:
    """A trial's status, rate (offered, and achieved when measured) and objective, for its progress line; what
    the rate search lost to other work where that was noticeable."""
    achieved = "" if record.achieved_rps is None else f" ({record.achieved_rps:.1f} achieved)"
    line = f"{record.status}, {record.sustainable_rps:.1f} rps{achieved}, objective {record.objective:.2f}"
    lost = record.interference
    return line + (f" [yellow]({lost.describe()})[/yellow]" if lost and lost.lost >= NOTICEABLE else "")


def _warn_interference(console: Console, study: TuningStudy) -> None:
    """Warn about the trials and repeat runs whose rate search lost a noticeable share of the node's CPUs."""

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
    runs = [*study.records(), *(run for runs in study.repeats().values() for run in runs)]
    elsewhere = Counter(run["machine"] for run in runs if run.get("machine") not in (None, machine_id()))
    if elsewhere:
        named = ", ".join(f"{count} on {machine}" for machine, count in elsewhere.items())
        console.print(f"[yellow]warning:[/yellow] study {study.name!r} holds measurements taken on other hardware "
                      f"({named}); this machine is {machine_id()}. Rates from different machines are not "
                      "comparable: use a new --study to profile this machine alone", soft_wrap=True)


def print_front(console: Console, records: list[dict]) -> list[dict]:
    """Print the Pareto front of ``records`` (objective up, p99 and memory down, within the limits the study
    applied) and return it, best objective first."""
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


def print_trials(console: Console, records: list[dict]) -> None:
    """Print every finished trial: configuration, status, rates, p99 and objective."""
    table = Table(title="trials")
    for column in ("#", "configuration", "status", "rps", "achieved rps", "p99 ms", "objective"):
        table.add_column(column)
    for number, record in enumerate(records, start=1):
        p99, achieved = record.get("p99_ms"), record.get("achieved_rps")
        table.add_row(str(number), str(record["config"]), str(record.get("status")),
                      f"{record.get('sustainable_rps', 0):.1f}", "-" if achieved is None else f"{achieved:.1f}",
                      "-" if p99 is None else f"{p99:.1f}", f"{record.get('objective', 0):.2f}")
    console.print(table)
