"""The profile bank: a directory of JSON files, one per profiled model, each holding trials over a search space.

``BankEntry`` is one file (format: docs/AUTOCONFIG.md); ``objective`` is set exactly when a trial's ``status`` is
``ok``. A full grid has one trial per configuration of the space.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from autoconfig.interference import Interference
from autoconfig.space import Configuration, ConfigurationField, SearchSpace, SpaceError, describe_validation_error

Status = Literal["ok", "failed", "slo_violated"]
#: What a repeat records per run beside its objective, as ``Repeats`` fields.
RunRecorded = Literal["codes", "machines", "interference"]


class BankError(ValueError):
    """An invalid or unusable bank file; the message names the file and field."""


class Measurement(BaseModel):
    """What one deployment of an application sustained."""

    model_config = ConfigDict(extra="forbid")

    rps: float | None = Field(None, ge=0.0, description="Highest sustainable request rate found (requests/s).")
    achieved_rps: float | None = Field(None, ge=0.0, description="2xx answers per second measured at that rate.")
    p50_ms: float | None = Field(None, ge=0.0, description="Median latency at that rate.")
    p99_ms: float | None = Field(None, ge=0.0, description="99th-percentile latency at that rate.")
    error_rate: float | None = Field(None, ge=0.0, le=1.0, description="Fraction of failed requests at that rate.")
    memory_mib: float | None = Field(None, ge=0.0, description="Resident memory of the app's replicas after the load.")
    status: Status
    objective: float | None = Field(None, ge=0.0, description="The objective; set exactly when status is ok.")
    code: str | None = Field(None, description="The swiftserve commit that measured it (None: not recorded).")
    machine: str | None = Field(None, description="The hardware that measured it: CPU model and count, GPU "
                                "(None: not recorded).")
    interference: Interference | None = Field(None, description="The node's CPU time its rate search lost to "
                                              "other work (None: not recorded).")
    duration_s: float | None = Field(None, ge=0.0, description="Wall time of the measurement: deploy or update, "
                                     "warm-up and rate search (None: not recorded).")

    @model_validator(mode="after")
    def _objective_iff_ok(self) -> Measurement:
        if (self.objective is None) == (self.status == "ok"):
            raise ValueError(
                f"objective: must be {'set' if self.status == 'ok' else 'null'} when status is {self.status!r}"
            )
        return self


class ProfileRecord(Measurement):
    """One trial: a configuration of the space and what it sustained."""

    config: ConfigurationField


class StartingPoint(Measurement):
    """The application as its Serve config has it (no knob applied), measured before the search: what tuning
    gains over."""

    resources: float | None = Field(None, ge=0.0, description="The devices its deployments held (the objective's "
                                    "divisor under rps_per_share).")
    reference_config: ConfigurationField | None = Field(None, description="The entry's best configuration, measured "
                                                        "again right after it where the grid came from another "
                                                        "session (None: measured with the grid).")
    reference_objective: float | None = Field(None, ge=0.0, description="Its objective then (None: not measured, "
                                              "or it held no rate).")


class Repeats(BaseModel):
    """One configuration measured several times, its trial first: the spread of its objective is the measurement
    noise. ``objectives`` holds None for a run that did not hold a rate within the SLO."""

    model_config = ConfigDict(extra="forbid")

    config: ConfigurationField
    objectives: list[float | None] = Field(min_length=2)
    codes: list[str | None] | None = Field(None, description="The swiftserve commit that measured each run.")
    machines: list[str | None] | None = Field(None, description="The hardware that measured each run.")
    interference: list[Interference | None] | None = Field(
        None, description="The node's CPU time each run's rate search lost to other work.")

    @model_validator(mode="after")
    def _a_value_per_run(self) -> Repeats:
        for name in get_args(RunRecorded):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.objectives):
                raise ValueError(f"{name}: {len(values)} for {len(self.objectives)} objectives")
        return self

    def per_run(self, name: RunRecorded) -> list[Any]:
        """Each run's ``codes``, ``machines`` or ``interference`` (None for each where not recorded)."""
        return getattr(self, name) or [None] * len(self.objectives)

    def relative_spread(self) -> float | None:
        """Standard deviation over mean of the ok runs (None with fewer than two, or a mean of 0)."""
        ok = [value for value in self.objectives if value is not None]
        if len(ok) < 2 or not np.mean(ok):
            return None
        return float(np.std(ok, ddof=1) / np.mean(ok))


def mean_of_runs(objectives: Sequence[float | None]) -> float:
    """The mean objective of a configuration's runs, a run that held no rate (None) counting 0."""
    return float(np.mean([value or 0.0 for value in objectives]))


class ModelDescription(BaseModel):
    """What was profiled; ``name`` identifies the entry (and its file), other fields are free-form."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128)


class BankEntry(BaseModel):
    """The profile of one model on one machine over one search space."""

    model_config = ConfigDict(extra="forbid")

    model: ModelDescription
    machine: dict[str, Any] = Field(default_factory=dict)
    space: SearchSpace
    objective: Literal["rps_per_share", "rps"] = "rps_per_share"
    trials: list[ProfileRecord]
    repeats: list[Repeats] = Field(default_factory=list)
    starting: StartingPoint | None = Field(None, description="The application's own configuration, measured "
                                           "before the grid (None: not recorded).")

    @model_validator(mode="after")
    def _trials_in_space(self) -> BankEntry:
        first: dict[Configuration, int] = {}
        for i, trial in enumerate(self.trials):
            try:
                trial.config = self.space.configuration(trial.config)  # the space's values: 4, not 4.0
            except SpaceError as exc:
                raise ValueError(f"trials[{i}].config: {exc}") from None
            if trial.config in first:
                raise ValueError(f"trials[{i}].config: duplicate of trials[{first[trial.config]}]")
            first[trial.config] = i
        for i, repeat in enumerate(self.repeats):
            try:
                repeat.config = self.space.configuration(repeat.config)
            except SpaceError as exc:
                raise ValueError(f"repeats[{i}].config: {exc}") from None
        return self

    def noise(self) -> float | None:
        """The median relative spread (std / mean) of the repeated configurations' objectives; None without
        repeats."""
        spreads = [spread for repeat in self.repeats if (spread := repeat.relative_spread()) is not None]
        return float(np.median(spreads)) if spreads else None

    def _every_measurement(self, field: str, per_run: RunRecorded) -> list[Any]:
        """``field`` of each trial, then ``per_run`` of each repeat's runs (None where not recorded)."""
        values = [getattr(trial, field) for trial in self.trials]
        for repeat in self.repeats:
            values += repeat.per_run(per_run)
        return values

    def code_versions(self) -> list[str | None]:
        """The distinct swiftserve commits that measured the entry's trials and repeat runs, in order of first use;
        None among them when some measurement did not record one."""
        return list(dict.fromkeys(self._every_measurement("code", "codes")))

    def machines(self) -> list[str | None]:
        """The distinct hardware that measured the entry's trials and repeat runs, in order of first use; None
        among them when some measurement did not record it."""
        return list(dict.fromkeys(self._every_measurement("machine", "machines")))

    def most_lost(self) -> float | None:
        """The largest share of the node's CPUs any trial or repeat run lost to other work (None: none recorded)."""
        lost = [recorded.lost for recorded in self._every_measurement("interference", "interference")
                if recorded is not None]
        return max(lost) if lost else None

    @property
    def name(self) -> str:
        return self.model.name

    def measured(self) -> dict[Configuration, float]:
        """Each profiled configuration's objective, 0 where it held no rate within the SLO. A repeated
        configuration's is the mean of its runs (a run that held none counting 0): the best of one measurement
        each is likely a lucky one."""
        values = {trial.config: trial.objective or 0.0 for trial in self.trials}
        for repeat in self.repeats:
            values[repeat.config] = mean_of_runs(repeat.objectives)
        return values

    def surface(self) -> tuple[tuple[Configuration, ...], np.ndarray]:
        """Every configuration in enumeration order and its :meth:`measured` objective (NaN where it is 0).

        Raises :class:`BankError` unless the trials cover the whole space.
        """
        if len(self.trials) != self.space.size:
            raise BankError(f"{self.name}: {len(self.trials)} trials, the space has {self.space.size} configurations")
        values = np.full(self.space.size, np.nan)
        for config, value in self.measured().items():
            if value > 0:
                values[self.space.index(config)] = value
        return self.space.configurations(), values

    def durations(self) -> np.ndarray:
        """Each configuration's trial wall time in enumeration order (seconds; NaN where not recorded)."""
        seconds = np.full(self.space.size, np.nan)
        for trial in self.trials:
            if trial.duration_s is not None:
                seconds[self.space.index(trial.config)] = trial.duration_s
        return seconds

    def gain_over_starting(self) -> float | None:
        """The optimum's objective over the app as configured (``starting``), the optimum as measured beside it
        where it was measured again; None where the starting point was not recorded or held no rate, or the
        optimum measured again held none."""
        starting = self.starting
        if starting is None or not starting.objective:
            return None
        if starting.reference_config is not None:
            return None if not starting.reference_objective else starting.reference_objective / starting.objective
        return max(self.measured().values()) / starting.objective

    @classmethod
    def load(cls, path: str | Path) -> BankEntry:
        """The entry in ``path``; a :class:`BankError` names the file and the field."""
        path = Path(path)
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise BankError(f"{path}: {exc}") from exc
        except ValidationError as exc:
            raise BankError(f"{path}: {describe_validation_error(exc)}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json", exclude_none=True), indent=1) + "\n")


def load_bank(directory: str | Path) -> list[BankEntry]:
    """Every ``*.json`` entry of a bank directory, ordered by file name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BankError(f"{directory}: not a directory")
    entries = [BankEntry.load(path) for path in sorted(directory.glob("*.json"))]
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise BankError(f"{directory}: model names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return entries


def measured_by(entries: Sequence[BankEntry],
                what: Callable[[BankEntry], list[str | None]] = BankEntry.code_versions) -> dict[str | None, list[str]]:
    """The entries' names under each code version (``what``: or :meth:`BankEntry.machines`) that measured some of
    them (None: measurements that recorded none), in order of first use: more than one key means the bank compares
    systems measured at different code, or on different hardware."""
    names: dict[str | None, list[str]] = {}
    for entry in entries:
        for measurer in what(entry):
            names.setdefault(measurer, []).append(entry.name)
    return names


def save_bank(entries: Sequence[BankEntry], directory: str | Path) -> None:
    """Write each entry to ``directory/<model name>.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        entry.save(directory / f"{entry.name}.json")
