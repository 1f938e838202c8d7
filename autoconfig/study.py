"""Tuning studies persisted in Optuna storage: a SQLite file by default, any Optuna RDB URL for a shared database.

One Optuna trial per finished profiling trial, written in one transaction once finished, so an interrupted study
(``kill -9`` included) keeps every finished trial and nothing half-written. The search space is stored with the
study. Storage layout, resume and durability: docs/AUTOCONFIG.md, "Studies".
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import optuna
import sqlalchemy
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autoconfig.bank import BankEntry, Measurement, ProfileRecord, Repeats, StartingPoint
from autoconfig.searchers.base import Observation
from autoconfig.space import Configuration, SearchSpace

_SPACE_ATTR = "search_space"
_REPEATS_ATTR = "repeats"
_STARTING_ATTR = "starting_point"
M = TypeVar("M", bound=Measurement)

optuna.logging.set_verbosity(optuna.logging.WARNING)


class StudyError(RuntimeError):
    """The storage cannot be used, or the study does not match the request; the message says why."""


def sqlite_url(path: str) -> str:
    """Optuna storage URL of a SQLite file."""
    return f"sqlite:///{path}"


def _storage(storage_url: str) -> optuna.storages.BaseStorage:
    """Optuna storage at ``storage_url``. A new SQLite file appears whole: SQLite commits each ``CREATE`` on its own,
    and a process killed between a table and its unique index would leave a schema that stores a study twice."""
    url = sqlalchemy.engine.make_url(storage_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") and "uri" not in url.query:
        path = Path(url.database)
        if not path.exists():
            _create_sqlite_schema(url, path)
    return optuna.storages.get_storage(storage_url)


def _create_sqlite_schema(url: sqlalchemy.engine.URL, path: Path) -> None:
    """Builds Optuna's schema in a fresh sibling file, then links it to ``path`` (atomic; a process that linked
    first wins). A kill mid-way leaves only the hidden ``.partial`` sibling."""
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:
        created = optuna.storages.RDBStorage(url.set(database=partial).render_as_string(hide_password=False))
        created.engine.dispose()
        os.link(partial, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(partial)


class TuningStudy:
    """The finished trials of one tuning run of one application, in Optuna storage."""

    def __init__(self, study: optuna.Study, space: SearchSpace) -> None:
        self._study = study
        self.space = space

    @classmethod
    def open(cls, storage_url: str, name: str, space: SearchSpace) -> TuningStudy:
        """The study ``name`` in ``storage_url``, created if new; refuses an unreachable storage before any trial
        runs, and a stored study whose search space differs from ``space``."""
        try:
            storage = _storage(storage_url)
            study = optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True)
        except Exception as error:  # sqlalchemy / driver errors carry the useful text
            raise StudyError(f"cannot open study {name!r} in storage {storage_url!r}: {error}") from error
        stored = study.user_attrs.get(_SPACE_ATTR)
        mine = space.to_dict()
        if stored is None:
            study.set_user_attr(_SPACE_ATTR, mine)
        elif stored != mine:
            raise StudyError(
                f"study {name!r} in {storage_url!r} was run over another search space; use a new --study name"
            )
        return cls(study, space)

    @classmethod
    def load(cls, storage_url: str, name: str) -> TuningStudy:
        """An existing study, over the search space stored with it (for reading: ``autoconfig report``)."""
        try:
            study = optuna.load_study(study_name=name, storage=optuna.storages.get_storage(storage_url))
        except KeyError:
            raise StudyError(f"no study {name!r} in storage {storage_url!r}") from None
        except Exception as error:
            raise StudyError(f"cannot open study {name!r} in storage {storage_url!r}: {error}") from error
        stored = study.user_attrs.get(_SPACE_ATTR)
        if stored is None:
            raise StudyError(f"study {name!r} in {storage_url!r} was not written by autoconfig (no search space)")
        return cls(study, SearchSpace.parse(stored))

    @property
    def name(self) -> str:
        return self._study.study_name

    def _finished(self) -> list[optuna.trial.FrozenTrial]:
        return self._study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))

    def history(self) -> list[Observation]:
        """Finished trials in order (not those another client left unfinished), as the searchers see them (failed
        or SLO-violating: value None)."""
        return [Observation(self.space.configuration(trial.params), trial.value, trial_metrics(trial.user_attrs))
                for trial in self._finished()]

    def records(self) -> list[dict[str, Any]]:
        """Every finished trial's configuration and measurements, in order."""
        return [{"config": dict(trial.params), **trial.user_attrs} for trial in self._finished()]

    def to_bank_entry(self, model: Mapping[str, Any], machine: Mapping[str, Any], objective: str) -> BankEntry:
        """The study as a profile-bank entry (``objective``: ``rate_per_share`` or ``max_rate``, as measured)."""
        records = self.records()
        trials = [_measurement(record, ProfileRecord, config=self.space.configuration(record["config"]))
                  for record in records]
        repeats = []
        for config, runs in self._repeated_runs(records).items():
            repeats.append(Repeats(config=config, objectives=[_objective(run) for run in runs],
                                   codes=_per_run(runs, "code"), machines=_per_run(runs, "machine"),
                                   interference=_per_run(runs, "interference")))
        starting = self.starting_point()
        return BankEntry(model=dict(model), machine=dict(machine), space=self.space, trials=trials,
                         objective="rps_per_share" if objective == "rate_per_share" else "rps", repeats=repeats,
                         starting=None if starting is None else _measurement(
                             starting, StartingPoint, resources=starting.get("resources"),
                             reference_config=starting.get("reference_config"),
                             reference_objective=starting.get("reference_objective")))

    def add_bank_entry(self, entry: BankEntry) -> None:
        """Stores ``entry``'s trials and repeats in this empty study (over the entry's space), so that a resumed
        ``profile`` measures only what its repeats still miss; ``to_bank_entry`` gives the entry back."""
        if self.space.to_dict() != entry.space.to_dict():
            raise StudyError(f"bank entry {entry.name!r} was profiled over another search space than study "
                             f"{self.name!r}")
        if self._finished() or self.repeats():
            raise StudyError(f"study {self.name!r} already holds trials; add bank entry {entry.name!r} to a new one")
        for trial in entry.trials:
            measured = trial.model_dump(exclude={"config", "rps"}, exclude_none=True)
            self.record(trial.config, trial.objective, {"sustainable_rps": trial.rps, **measured})
        if entry.starting is not None:
            measured = entry.starting.model_dump(exclude={"rps"}, exclude_none=True)
            self.record_starting_point({"sustainable_rps": entry.starting.rps, **measured})
        for repeat in entry.repeats:
            runs = zip(repeat.objectives, repeat.per_run("codes"), repeat.per_run("machines"),
                       repeat.per_run("interference"), strict=True)
            for value, code, machine, lost in list(runs)[1:]:
                run = {"status": "ok", "objective": value} if value is not None else {"status": "slo_violated"}
                recorded = {"code": code, "machine": machine, "interference": lost and lost.model_dump()}
                self.record_repeat(repeat.config, run | {key: item for key, item in recorded.items() if item})

    def starting_point(self) -> dict[str, Any] | None:
        """The application's own configuration as measured (``record_starting_point``), or None."""
        return self._study.user_attrs.get(_STARTING_ATTR)

    def record_starting_point(self, measurements: Mapping[str, Any]) -> None:
        """Stores the measurement of the application as its Serve config has it (a trial record's fields)."""
        self._study.set_user_attr(_STARTING_ATTR, {key: _json_safe(item) for key, item in measurements.items()})

    def repeats(self) -> dict[Configuration, list[dict[str, Any]]]:
        """The repeated measurements of configurations (``record_repeat``), in the order first repeated."""
        stored = self._study.user_attrs.get(_REPEATS_ATTR, [])
        return {self.space.configuration(entry["config"]): entry["runs"] for entry in stored}

    def repeated_objectives(self) -> dict[Configuration, list[float | None]]:
        """Each repeated configuration's objectives, its trial's first (None: a run that was not ok)."""
        return {config: [_objective(run) for run in runs] for config, runs in self._repeated_runs().items()}

    def _repeated_runs(self, records: list[dict[str, Any]] | None = None) -> dict[Configuration, list[dict[str, Any]]]:
        """Each repeated configuration's measurements, its trial's record first (``records``: :meth:`records`, when
        already read)."""
        records = self.records() if records is None else records
        first = {self.space.configuration(record["config"]): record for record in records}
        return {config: [first[config], *runs] for config, runs in self.repeats().items() if config in first}

    def record_repeat(self, config: Configuration, measurements: Mapping[str, Any]) -> None:
        """Stores one more measurement of an already profiled ``config`` (the study's trials stay one per
        configuration: the searchers' history is unchanged)."""
        stored = list(self._study.user_attrs.get(_REPEATS_ATTR, []))
        params = config.as_dict()
        entry = next((entry for entry in stored if entry["config"] == params), None)
        if entry is None:
            stored.append(entry := {"config": params, "runs": []})
        entry["runs"] = [*entry["runs"], {key: _json_safe(item) for key, item in measurements.items()}]
        self._study.set_user_attr(_REPEATS_ATTR, stored)

    def record(self, config: Configuration, value: float | None, measurements: Mapping[str, Any]) -> None:
        """Stores one finished trial: ``value`` None marks it failed (crash, or no rate within the SLO)."""
        params = config.as_dict()
        distributions = {name: CategoricalDistribution(self.space.values(name)) for name in params}
        trial = optuna.trial.create_trial(
            params=params,
            distributions=distributions,
            value=value,
            state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
            user_attrs={key: _json_safe(item) for key, item in measurements.items()},
        )
        self._study.add_trial(trial)


def _measurement(record: Mapping[str, Any], kind: type[M], **fields: Any) -> M:
    """A bank ``Measurement`` of ``kind`` from a stored trial record's fields."""
    return kind(rps=record.get("sustainable_rps"), achieved_rps=record.get("achieved_rps"),
                p50_ms=record.get("p50_ms"), p99_ms=record.get("p99_ms"), error_rate=record.get("error_rate"),
                memory_mib=record.get("memory_mib"), status=record["status"], objective=_objective(record),
                code=record.get("code"), machine=record.get("machine"), interference=record.get("interference"),
                duration_s=record.get("duration_s"), **fields)


def trial_metrics(attrs: Mapping[str, Any]) -> dict[str, float]:
    """The measurements a multi-objective searcher weighs, where a trial has them."""
    return {name: float(attrs[name]) for name in ("p99_ms", "memory_mib", "violation") if attrs.get(name) is not None}


def _per_run(runs: list[dict[str, Any]], key: str) -> list[Any] | None:
    """Each run's ``key``, or None where no run recorded it."""
    values = [run.get(key) for run in runs]
    return values if any(value is not None for value in values) else None


def _objective(record: Mapping[str, Any]) -> float | None:
    return record.get("objective") if record.get("status") == "ok" else None


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
