"""The tuning loop: ask the searcher, profile the configuration, persist the trial, until the budget is spent.

Resuming is the same call: the study's finished trials are the history, so a restarted ``tune`` continues
where it stopped and never repeats a finished configuration. A trial stopped before it was stored leaves nothing
(its configuration may be profiled again); one stored but not yet passed to ``on_trial`` counts as finished.
After the budget, ``repeat_best`` measures the best configurations again and ``confirmed_best`` picks the one with
the best mean: on a noisy machine the best single measurement is often a lucky one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoconfig.bank import mean_of_runs
from autoconfig.pareto import Limits
from autoconfig.searchers.base import Observation, Searcher, SpaceExhausted
from autoconfig.space import Configuration
from autoconfig.study import TuningStudy, trial_metrics
from autoconfig.trial import TrialRecord


@dataclass(frozen=True)
class TuneOutcome:
    """The study's trials after this run; ``best`` is None when no configuration met the SLO."""

    history: list[Observation]
    best: Observation | None
    ran: int
    exhausted: bool


def best_observation(history: list[Observation]) -> Observation | None:
    """The feasible observation with the highest objective (earliest on ties)."""
    feasible = [observation for observation in history if observation.value is not None]
    return max(feasible, key=lambda observation: observation.value, default=None)


def tune(
    study: TuningStudy,
    searcher: Searcher,
    profile: Callable[[Configuration], TrialRecord],
    *,
    budget: int,
    limits: Limits | None = None,
    on_trial: Callable[[int, Configuration, TrialRecord], None] | None = None,
) -> TuneOutcome:
    """Profiles configurations chosen by ``searcher`` until the study holds ``budget`` finished trials. A trial over
    ``limits`` counts as not met (value None), its ``violation`` and ``limit`` message stored beside it."""
    history = study.history()
    ran = 0
    exhausted = False
    while len(history) < budget:
        try:
            config = searcher.suggest(history)
        except SpaceExhausted:
            exhausted = True
            break
        record = profile(config)
        measurements = record.model_dump(exclude={"search", "configuration"})
        violation, why = (limits or Limits()).violation(measurements)
        measurements |= {"violation": violation} | ({"limit": why} if why else {})
        value = record.objective if record.status == "ok" and violation == 0.0 else None
        study.record(config, value, measurements)
        history.append(Observation(config, value, trial_metrics(measurements)))
        ran += 1
        if on_trial is not None:
            on_trial(len(history), config, record)
    return TuneOutcome(history, best_observation(history), ran, exhausted)


def repeat_best(
    study: TuningStudy,
    profile: Callable[[Configuration], TrialRecord],
    *,
    configs: int,
    runs: int,
    limit: int,
    on_repeat: Callable[[Configuration, int, TrialRecord], None] | None = None,
) -> dict[Configuration, list[float | None]]:
    """Races the best: measures the best configuration with fewer than ``runs`` measurements (its trial first) until
    it has them, re-ranks by the estimates (a repeated configuration's mean, a run that held no rate counting 0;
    another's one run), and goes on until the study's ``configs`` best all have ``runs``, so a single lucky run
    cannot stay on top (SMAC's intensification). At most ``limit`` configurations are repeated. Each run is stored
    as it finishes (a resumed call runs only what is missing). Returns every repeated configuration's objectives
    (None: not ok), best mean first."""
    measured = study.repeated_objectives()
    while runs > 1:
        pending = _unconfirmed(study, measured, configs, runs)
        if not pending or (pending[0] not in measured and len(measured) >= limit):
            break
        config = pending[0]
        for run in range(len(measured.get(config, [None])), runs):
            record = profile(config)
            study.record_repeat(config, record.model_dump(exclude={"search", "configuration"}))
            if on_repeat is not None:
                on_repeat(config, run + 1, record)
        measured = study.repeated_objectives()
    return dict(sorted(measured.items(), key=lambda item: -mean_of_runs(item[1])))


def unconfirmed(study: TuningStudy, *, configs: int, runs: int) -> list[Configuration]:
    """Of the study's ``configs`` best by their estimates (a repeated configuration's mean, a run that held no rate
    counting 0; another's one run; earliest on ties), those with fewer than ``runs`` measurements, best first."""
    return _unconfirmed(study, study.repeated_objectives(), configs, runs)


def _unconfirmed(study: TuningStudy, measured: dict[Configuration, list[float | None]], configs: int,
                 runs: int) -> list[Configuration]:
    """``unconfirmed`` given the study's repeated objectives, already read."""
    estimates = {o.config: mean_of_runs(measured[o.config]) if o.config in measured else o.value
                 for o in study.history() if o.value is not None}
    best = sorted(estimates, key=lambda config: -estimates[config])[:configs]
    return [config for config in best if len(measured.get(config, [None])) < runs]


def confirmed_best(measured: dict[Configuration, list[float | None]]) -> Observation | None:
    """Of ``repeat_best``'s configurations, the one with the highest mean objective over its runs (a run that held
    no rate counting 0, so a configuration that holds the SLO only sometimes loses; earliest on ties), as an
    observation valued at that mean; None when there is none."""
    means = {config: mean_of_runs(runs) for config, runs in measured.items() if runs}
    if not means:
        return None
    config = max(means, key=means.__getitem__)
    return Observation(config, means[config])


def remeasured_while_interfered(
    profile: Callable[[Configuration], TrialRecord],
    *,
    limit: float,
    retries: int,
    on_retry: Callable[[Configuration, int, TrialRecord], None] | None = None,
) -> Callable[[Configuration], TrialRecord]:
    """``profile``, measuring a configuration again while its rate search lost ``limit`` or more of the node's CPUs
    to other work (``TrialRecord.interference``), at most ``retries`` more times; the last measurement is kept.
    ``on_retry`` gets each measurement set aside and its attempt number (1 for the first)."""

    def measure(config: Configuration) -> TrialRecord:
        record = profile(config)
        for attempt in range(1, retries + 1):
            if record.interference is None or record.interference.lost < limit:
                break
            if on_retry is not None:
                on_retry(config, attempt, record)
            record = profile(config)
        return record

    return measure
