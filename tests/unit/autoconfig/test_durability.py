"""Durability of autoconfig studies: ``tune`` stopped at any point (SIGKILL, SIGTERM, Ctrl-C) resumes with every
finished trial intact, nothing half-written and nothing profiled twice.

The storage is real (Optuna over SQLite); trials are fakes of a few milliseconds, so a child spends much of its
time in Optuna's writes and kills land inside them. Children fork from a server that imported everything once:
a fresh interpreter would take seconds per kill. The CLI runs without Ray: its child fakes ``ray.is_initialized``,
``run_trial`` and ``delete_trial_app``.
"""

from __future__ import annotations

import ast
import itertools
import json
import multiprocessing
import multiprocessing.forkserver
import os
import random
import re
import signal
import sqlite3
import statistics
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import optuna
import pytest
import ray
import sqlalchemy
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.storages._rdb import models
from optuna.trial import FrozenTrial, TrialState

import autoconfig.trial
from autoconfig.cli import main
from autoconfig.searchers import GridSearcher, RandomSearcher
from autoconfig.space import Configuration, SearchSpace
from autoconfig.study import StudyError, TuningStudy, sqlite_url
from autoconfig.trial import TrialRecord
from autoconfig.tuner import tune
from tests.helpers import REPO

SPACE = SearchSpace.parse({"knobs": {
    "max_batch_size": {"values": [1, 4, 16]},
    "batch_wait_timeout_s": {"values": [0.0, 0.01]},
    "device_share": {"values": [0.5, 1.0]},
    "num_replicas": {"values": [1, 2]},
}})
STUDY = "durable"
BUDGET = 18
PROFILE_S = 0.005  # a fake trial; also the child's "progress line" after each write
MEASURED = {"status", "objective", "sustainable_rps", "p99_ms", "duration_s"}
SILENT_CHILD_S = 60.0


def measure(config: Configuration) -> TrialRecord:
    """A fake trial: arbitrary floats fixed by the configuration; about a third of them break the SLO."""
    time.sleep(PROFILE_S)
    draw = random.Random(json.dumps(config.as_dict(), sort_keys=True))
    p99_ms, rate = draw.uniform(1.0, 75.0), draw.uniform(1.0, 500.0)
    ok = p99_ms <= 50.0
    return TrialRecord(app_name="dlrm", configuration=config.as_dict(), status="ok" if ok else "slo_violated",
                       objective_name="max_rate", objective=rate if ok else 0.0, sustainable_rps=rate,
                       p99_ms=p99_ms, duration_s=PROFILE_S)


@pytest.fixture(scope="module")
def forkserver() -> Iterator[BaseContext]:
    """Children forked from a server that imported once what they need: this module, Optuna's SQL storage (which
    imports SQLAlchemy and Alembic on first use) and what the CLI imports to load a DLRM Serve config."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "optuna.storages._rdb.models", "alembic.command", "alembic.migration",
                                    "alembic.script", "disagg.app", "autoconfig.serve_config"])
    yield context
    multiprocessing.forkserver._forkserver._stop()  # as CPython's tests do: the server holds ~350 MB of imports


# ---- SIGKILL at many points -------------------------------------------------------------------------------------


class _MarkedStudy(TuningStudy):
    """Tells the parent when each trial's write starts and when it returned."""

    mark: Callable[..., None]

    def record(self, config: Configuration, value: float | None, measurements: Mapping[str, Any]) -> None:
        self.mark("writing")
        super().record(config, value, measurements)
        self.mark("written")


def _tune_telling_the_parent(url: str, seed: int, marks: Connection) -> None:
    """The child: resumes the study and tunes it; each marker is one write on a pipe, so a kill loses none sent."""

    def mark(phase: str, **details: Any) -> None:
        marks.send_bytes(json.dumps({"phase": phase, **details}).encode())

    def profile(config: Configuration) -> TrialRecord:
        mark("profiling")
        return measure(config)

    def report(number: int, config: Configuration, record: TrialRecord) -> None:
        time.sleep(PROFILE_S)  # stored, not yet reported: a kill here must neither lose nor repeat the trial
        mark("finished", number=number, config=config.as_dict(), measured=record.model_dump(include=MEASURED))

    mark("opening")
    try:
        study = _MarkedStudy.open(url, STUDY, SPACE)
        study.mark = mark
        mark("opened")
        tune(study, RandomSearcher(SPACE, seed=seed), profile, budget=BUDGET, on_trial=report)
    except Exception:
        mark("failed", error=traceback.format_exc())  # for the parent's assertion: stderr is shared with Ray's logs
        raise


# Where a kill is aimed: after the n-th marker of a kind (n up to 1 or 2 per child), then a random part of that
# phase's usual length. Where it landed is told by the last marker the child sent.
TARGETS = (("opening", "opening", 1), ("profiling", "profiling", 2), ("writing", "writing", 2),
           ("between trials", "written", 2))
PHASE_AFTER = {None: "starting", "opening": "opening", "profiling": "profiling", "writing": "writing"}  # else: between


@dataclass
class Run:
    """One child as the parent saw it: its markers (arrival time, content), how many of them arrived before the
    kill was aimed (their times are the child's), and whether a SIGKILL ended it."""

    markers: list[tuple[float, dict[str, Any]]]
    aimed: int = 0
    killed: bool = False

    @property
    def last(self) -> str | None:
        return self.markers[-1][1]["phase"] if self.markers else None

    @property
    def phase(self) -> str:
        return PHASE_AFTER.get(self.last, "between trials")  # after "opened", "written" or "finished"

    @property
    def finished(self) -> list[dict[str, Any]]:
        return [marker for _, marker in self.markers if marker["phase"] == "finished"]


def _read_until(reader: Connection, run: Run, anchor: str, occurrence: int) -> bool:
    """Reads markers until the ``occurrence``-th ``anchor`` one; False if the child ended first."""
    seen = 0
    while seen < occurrence:
        assert reader.poll(SILENT_CHILD_S), "the child went silent"
        try:
            marker = json.loads(reader.recv_bytes())
        except EOFError:
            return False
        run.markers.append((time.monotonic(), marker))
        seen += marker["phase"] == anchor
    return True


def _drain(reader: Connection, run: Run) -> None:
    while True:
        try:
            run.markers.append((time.monotonic(), json.loads(reader.recv_bytes())))
        except EOFError:
            return


def _run_child(context: BaseContext, url: str, seed: int, anchor: str, occurrence: int, delay_s: float) -> Run:
    """Starts a tuning child and SIGKILLs it ``delay_s`` after its ``occurrence``-th ``anchor`` marker."""
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_tune_telling_the_parent, args=(url, seed, writer), daemon=True)
    child.start()
    writer.close()
    run = Run([])
    if _read_until(reader, run, anchor, occurrence):
        time.sleep(delay_s)
        child.kill()
    run.aimed = len(run.markers)
    child.join(SILENT_CHILD_S)
    _drain(reader, run)
    run.killed = child.exitcode == -signal.SIGKILL
    failures = [marker["error"] for _, marker in run.markers if marker["phase"] == "failed"]
    assert run.killed or child.exitcode == 0, f"the child failed with exit code {child.exitcode}: {failures}"
    return run


def _phase_lengths(run: Run, lengths: dict[str, list[float]]) -> None:
    """How long each marker was followed by silence (before the kill), for aiming later kills."""
    seen = run.markers[: run.aimed]
    for (start, marker), (end, _) in itertools.pairwise(seen):
        lengths[marker["phase"]].append(end - start)


def _integrity(db: Path) -> None:
    """What any SQLite reader sees after the kill (opening rolls back a hot journal first)."""
    with closing(sqlite3.connect(db)) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert connection.execute("PRAGMA foreign_key_check").fetchall() == []


def _same_trial(stored: FrozenTrial, reported: dict[str, Any]) -> bool:
    measured = reported["measured"]
    ok = measured["status"] == "ok"
    return (stored.params == reported["config"] and stored.value == (measured["objective"] if ok else None)
            and stored.state == (TrialState.COMPLETE if ok else TrialState.FAIL)
            and {key: stored.user_attrs.get(key) for key in MEASURED} == measured)


def _check_storage(storage: optuna.storages.BaseStorage | str, previous: list[FrozenTrial],
                   reported: dict[int, dict[str, Any]], study: str = STUDY) -> list[FrozenTrial]:
    """Only finished trials, none repeated, the earlier ones unchanged, every reported one stored as reported."""
    stored = optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)
    assert all(trial.state in (TrialState.COMPLETE, TrialState.FAIL) for trial in stored)  # nothing half-written
    assert len({tuple(sorted(trial.params.items())) for trial in stored}) == len(stored)  # no repeats
    assert [(t.params, t.value, t.user_attrs) for t in stored[: len(previous)]] == [
        (t.params, t.value, t.user_attrs) for t in previous]
    for number, trial in reported.items():
        assert number <= len(stored) and _same_trial(stored[number - 1], trial), f"trial {number} lost or changed"
    return stored


def test_a_tune_sigkilled_at_many_points_keeps_every_finished_trial_and_completes_on_resume(forkserver, tmp_path):
    db = tmp_path / "studies.db"
    url, journal = sqlite_url(db), db.with_name(db.name + "-journal")
    draw = random.Random(20240609)
    # How long each phase lasts: first guesses (a fresh storage creates its schema: a tenth of a second or more),
    # then what the children show.
    lengths: dict[str, list[float]] = defaultdict(list, opening=[0.2], profiling=[0.01], writing=[0.02], written=[0.01])
    storage: optuna.storages.RDBStorage | None = None  # opened by the parent once a child created the schema
    stored: list[FrozenTrial] = []
    reported: dict[int, dict[str, Any]] = {}
    phases: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    for attempt in range(100):
        _, anchor, most = min(TARGETS, key=lambda aim: phases[aim[0]])  # aimed at the phase hit least so far
        delay_s = draw.random() * statistics.median(lengths[anchor])
        run = _run_child(forkserver, url, attempt, anchor, draw.randint(1, most), delay_s)
        _phase_lengths(run, lengths)
        outcomes["hot journal left"] += journal.exists()  # killed inside a SQLite write transaction
        if db.exists():
            _integrity(db)
        if storage is None and any(marker["phase"] == "opened" for _, marker in run.markers):
            storage = optuna.storages.RDBStorage(url)
        reported |= {marker["number"]: marker for marker in run.finished}
        if storage is not None:
            before, stored = len(stored), _check_storage(storage, stored, reported)
            unreported = len(stored) - before - len(run.finished)  # stored, then killed before saying so
            assert unreported in {"writing": (0, 1), "written": (1,)}.get(run.last, (0,)), (run.last, unreported)
            outcomes["stored, unreported"] += unreported
            outcomes["write rolled back"] += run.last == "writing" and not unreported
        if not run.killed:
            break
        phases[run.phase] += 1
    assert not run.killed and len(stored) == BUDGET  # the last run spent the budget without a repeat
    assert len(TuningStudy.open(url, STUDY, SPACE).history()) == BUDGET
    typical_ms = {anchor: round(1000 * statistics.median(gaps), 1) for anchor, gaps in lengths.items()}
    print(f"\n{phases.total()} SIGKILLs by phase {dict(phases)}, {dict(outcomes)}; typical ms after each marker "
          f"{typical_ms}; finished trials lost: 0 of {len(reported)} reported")
    assert phases.total() >= 20 and all(phases[target] >= 2 for target, *_ in TARGETS), phases
    assert outcomes["hot journal left"] >= 1 and outcomes["stored, unreported"] >= 1, outcomes


def test_a_storage_whose_creation_died_is_not_left_half_made(tmp_path, monkeypatch):
    """SQLite commits each CREATE on its own: a death after the studies table and before its unique index would let
    every later open create the study again. The file appears whole or not at all."""
    db = tmp_path / "studies.db"

    def dies_after_the_first_table(bind: Any, **_: Any) -> None:
        with bind.begin() as connection:
            connection.execute(sqlalchemy.schema.CreateTable(models.BaseModel.metadata.tables["studies"]))
        raise RuntimeError("killed while creating the schema")

    with monkeypatch.context() as patch:
        patch.setattr(models.BaseModel.metadata, "create_all", dies_after_the_first_table)
        with pytest.raises(StudyError, match="killed while creating the schema"):
            TuningStudy.open(sqlite_url(db), STUDY, SPACE)
    assert list(tmp_path.iterdir()) == []  # neither the storage nor the sibling it was built in
    for _ in range(2):
        TuningStudy.open(sqlite_url(db), STUDY, SPACE)
    with closing(sqlite3.connect(db)) as connection:
        assert connection.execute("SELECT count(*) FROM studies").fetchone() == (1,)


def test_an_unfinished_trial_in_the_storage_is_neither_a_result_nor_a_block(tmp_path):
    """As another Optuna client killed mid-trial leaves one: the study ignores it and may profile its config."""
    url = sqlite_url(tmp_path / "s.db")
    tune(TuningStudy.open(url, STUDY, SPACE), GridSearcher(SPACE), measure, budget=3)
    raw = optuna.load_study(study_name=STUDY, storage=url)
    next_in_grid = SPACE.configurations()[3].as_dict()
    raw.enqueue_trial(next_in_grid)
    running = raw.ask({name: CategoricalDistribution(SPACE.values(name)) for name in next_in_grid})  # left so
    assert running.params == next_in_grid
    study = TuningStudy.open(url, STUDY, SPACE)
    assert len(study.history()) == len(study.records()) == 3
    outcome = tune(study, GridSearcher(SPACE), measure, budget=5)
    assert outcome.ran == 2 and outcome.history[3].config.as_dict() == next_in_grid
    assert [trial.state for trial in raw.get_trials()].count(TrialState.RUNNING) == 1


# ---- SIGTERM and Ctrl-C of the CLI ------------------------------------------------------------------------------


def _fake_run_trial(stall_after: int | None) -> Callable[..., TrialRecord]:
    """Fake trials of 30 ms; from trial ``stall_after + 1`` on, one lasts until a signal (or ``SILENT_CHILD_S``),
    so the parent always stops the child in the middle of a trial, whatever the machine's load."""
    started = 0

    def run_trial(template: Any, app_name: str, configuration: dict[str, Any], workload: Any, slo_p99_ms: float,
                  **options: Any) -> TrialRecord:
        nonlocal started
        if not configuration:  # the app as configured, measured once before the first trial
            return measure(Configuration(**configuration))
        started += 1
        time.sleep(SILENT_CHILD_S if stall_after is not None and started > stall_after else 0.03)
        return measure(Configuration(**configuration))

    return run_trial


def _cli_tune(argv: list[str], log: str, stall_after: int | None) -> None:
    """The child: ``autoconfig tune`` as the console script runs it, on fake trials, as if connected to Ray."""
    sys.stdout = sys.stderr = open(log, "w", buffering=1)  # noqa: SIM115 (the child's output, until it exits)
    os.environ["COLUMNS"] = "250"  # one line per trial
    ray.is_initialized = lambda: True  # the CLI neither starts nor stops a cluster
    autoconfig.trial.run_trial = _fake_run_trial(stall_after)
    autoconfig.trial.delete_trial_app = lambda name: print(f"deleted trial app {name}")
    sys.exit(main(argv))


TRIAL_LINE = re.compile(r"^trial (\d+): (\{.*?\}) -> ", re.MULTILINE)


def _cli_run(context: BaseContext, argv: list[str], log: Path, stop: signal.Signals | None = None,
             after_trials: int = 0) -> tuple[int, str]:
    """Runs the CLI child, sending ``stop`` once it printed ``after_trials`` trials (the next one stalls until
    then); exit code and output."""
    stall_after = after_trials if stop is not None else None
    child = context.Process(target=_cli_tune, args=(argv, str(log), stall_after), daemon=True)
    child.start()
    deadline = time.monotonic() + SILENT_CHILD_S
    while stop is not None and child.is_alive() and time.monotonic() < deadline:
        if log.exists() and len(TRIAL_LINE.findall(log.read_text())) >= after_trials:
            os.kill(child.pid, stop)
            break
        time.sleep(0.005)
    child.join(SILENT_CHILD_S)
    return child.exitcode, log.read_text()


def _dlrm_template(directory: Path) -> Path:
    """The shipped Serve config with only its DLRM app (validating it imports no diffusion code)."""
    config = yaml.safe_load((REPO / "deploy/serve_config.yaml").read_text())
    config["applications"] = [app for app in config["applications"] if app["name"] == "dlrm"]
    path = directory / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(("stop", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_the_cli_stopped_by_a_signal_keeps_its_trials_deletes_the_trial_app_and_resumes(
        forkserver, tmp_path, stop, exit_code):
    db = tmp_path / "s.db"
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE.to_dict()))
    argv = ["tune", "--config", str(_dlrm_template(tmp_path)), "--app", "dlrm", "--slo-p99-ms", "50",
            "--space", str(space), "--storage", sqlite_url(db), "--study", "cli", "--searcher", "random",
            "--budget", "6", "--out", str(tmp_path / "tuned.yaml")]
    code, output = _cli_run(forkserver, argv, tmp_path / "stopped.log", stop, after_trials=3)
    assert code == exit_code, output
    assert "run the same command to resume" in output and "deleted trial app" in output
    _integrity(db)
    printed = {int(number): ast.literal_eval(config) for number, config in TRIAL_LINE.findall(output)}
    stored = optuna.load_study(study_name="cli", storage=sqlite_url(db)).get_trials(deepcopy=False)
    assert len(printed) >= 3 and all(stored[number - 1].params == config for number, config in printed.items())
    assert all(trial.state in (TrialState.COMPLETE, TrialState.FAIL) for trial in stored)

    code, output = _cli_run(forkserver, argv, tmp_path / "resumed.log")
    assert code == 0 and (tmp_path / "tuned.yaml").is_file(), output
    assert f"{len(stored)} finished trial(s)" in output
    _check_storage(sqlite_url(db), stored, {}, study="cli")
    assert len(TuningStudy.open(sqlite_url(db), "cli", SPACE).history()) == 6
