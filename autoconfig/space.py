"""The search space: each knob a finite list of values, so every configuration can be enumerated.

``SearchSpace`` is read from a YAML space file (format: docs/AUTOCONFIG.md); errors name the field
(``knobs.max_batch_size.values[2]: ...``). ``encode`` maps a configuration into ``[0, 1]^d`` for model-based
searchers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from serving.common.http import field_path

MAX_SPACE_SIZE = 100_000
SPACES_DIR = Path(__file__).parent / "spaces"
KNOB_NAMES = ("max_batch_size", "batch_wait_timeout_s", "device_share", "num_replicas", "torch_threads")
_LOG_KNOBS = {"max_batch_size": 0.0, "batch_wait_timeout_s": 1e-3}  # knob -> offset added before the log


class SpaceError(ValueError):
    """An invalid space file or configuration; the message names the field."""


@dataclass(frozen=True, order=True)
class Configuration:
    """One point of a search space."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # unknown knobs in a bank file are refused

    max_batch_size: int
    batch_wait_timeout_s: float
    device_share: float
    num_replicas: int
    torch_threads: int | None = None

    def as_dict(self) -> dict[str, int | float]:
        """Knob -> value, without knobs the space does not have."""
        return {name: value for name, value in asdict(self).items() if value is not None}


class _Knob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    values: tuple[float, ...]

    @field_validator("values")
    @classmethod
    def _unique_sorted(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        seen: set[float] = set()
        for value in values:
            if value in seen:
                raise ValueError(f"duplicate value {value}")
            seen.add(value)
        return tuple(sorted(values))


class _CountKnob(_Knob):
    values: tuple[Annotated[StrictInt, Field(ge=1, le=65_536)], ...] = Field(min_length=1)


class _TimeoutKnob(_Knob):
    values: tuple[Annotated[float, Field(ge=0.0, le=10.0)], ...] = Field(min_length=1)


class _ShareKnob(_Knob):
    values: tuple[Annotated[float, Field(gt=0.0, le=1024.0)], ...] = Field(min_length=1)


class Knobs(BaseModel):
    """The knobs of a space; ``torch_threads`` is optional, any other name is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: _CountKnob = Field(description="Most requests merged into one forward pass.")
    batch_wait_timeout_s: _TimeoutKnob = Field(description="Seconds the first request of a batch waits.")
    device_share: _ShareKnob = Field(description="CPUs per replica on CPU, fraction of one GPU on GPU.")
    num_replicas: _CountKnob = Field(description="Replicas of the deployment.")
    torch_threads: _CountKnob | None = Field(None, description="torch intra-op threads per replica.")


class SearchSpace(BaseModel):
    """A finite grid of configurations; the objective (a rate, >= 0) is maximised."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    knobs: Knobs
    max_total_share: float | None = Field(
        None, gt=0.0, description="Configurations with num_replicas * device_share above this are left out."
    )

    @model_validator(mode="after")
    def _bounded(self) -> SearchSpace:
        grid = math.prod(len(self.values(name)) for name in self.knob_names)
        if grid > MAX_SPACE_SIZE:
            raise ValueError(f"knobs: {grid} combinations, more than the limit of {MAX_SPACE_SIZE}")
        if not self.configurations():
            raise ValueError(f"max_total_share: {self.max_total_share} leaves no configuration")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> SearchSpace:
        """Load a space file; a :class:`SpaceError` names the file and the offending field."""
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:  # not UTF-8; nested too deeply
            raise SpaceError(f"{path}: {exc}") from exc
        return cls.parse(raw, source=str(path))

    @classmethod
    def parse(cls, raw: Any, *, source: str = "space") -> SearchSpace:
        """Validate a space given as plain data (e.g. from a bank file)."""
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise SpaceError(f"{source}: {describe_validation_error(exc)}") from exc

    @classmethod
    def default(cls, kind: str) -> SearchSpace:
        """The shipped space for ``kind`` (``dlrm`` or ``diffusion``); any other name is refused before a path is
        made of it."""
        known = sorted(p.stem for p in SPACES_DIR.glob("*.yaml"))
        if kind not in known:
            raise SpaceError(f"no default space for kind {kind!r}; known: {', '.join(known)}")
        return cls.from_yaml(SPACES_DIR / f"{kind}.yaml")

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :meth:`parse` reads back."""
        return self.model_dump(mode="json", exclude_none=True)

    @property
    def knob_names(self) -> tuple[str, ...]:
        """The knobs this space has, in enumeration order."""
        return tuple(name for name in KNOB_NAMES if getattr(self.knobs, name) is not None)

    @property
    def size(self) -> int:
        return len(self.configurations())

    def configurations(self) -> tuple[Configuration, ...]:
        """Every configuration, in a fixed order (the last knob varies fastest; values ascending)."""
        return self._configurations

    def index(self, config: Configuration) -> int:
        """Position of ``config`` in :meth:`configurations`."""
        try:
            return self._index[config]
        except KeyError:
            raise SpaceError(f"configuration {config.as_dict()} is not in the search space") from None

    def encode(self, config: Configuration) -> np.ndarray:
        """``config`` as a point of ``[0, 1]^d``, one coordinate per knob (:meth:`coordinates`)."""
        return self.encode_all()[self.index(config)]

    def encode_all(self) -> np.ndarray:
        """Encoding of every configuration, shape ``(size, d)``, rows in enumeration order (read-only)."""
        return self._encoded

    def values(self, name: str) -> tuple[float, ...]:
        """The values of knob ``name``, ascending."""
        return getattr(self.knobs, name).values

    def coordinates(self, name: str) -> np.ndarray:
        """The encoded coordinate in ``[0, 1]`` of each value of knob ``name``: min-max scaled over its values, after
        ``log(v)`` for ``max_batch_size`` and ``log(v + 1 ms)`` for ``batch_wait_timeout_s``; other knobs linear."""
        values = np.array(self.values(name), dtype=np.float64)
        if name in _LOG_KNOBS:
            values = np.log(values + _LOG_KNOBS[name])
        span = values[-1] - values[0]
        return (values - values[0]) / span if span > 0 else np.full_like(values, 0.5)

    @cached_property
    def _configurations(self) -> tuple[Configuration, ...]:
        names = self.knob_names
        configs = (
            Configuration(**dict(zip(names, combo, strict=True)))
            for combo in itertools.product(*(self.values(name) for name in names))
        )
        if self.max_total_share is None:
            return tuple(configs)
        limit = self.max_total_share + 1e-9
        return tuple(c for c in configs if c.num_replicas * c.device_share <= limit)

    @cached_property
    def _index(self) -> dict[Configuration, int]:
        return {config: i for i, config in enumerate(self._configurations)}

    @cached_property
    def _encoded(self) -> np.ndarray:
        columns = []
        for name in self.knob_names:
            position = {value: i for i, value in enumerate(self.values(name))}
            indices = [position[getattr(config, name)] for config in self._configurations]
            columns.append(self.coordinates(name)[indices])
        encoded = np.stack(columns, axis=1)
        encoded.flags.writeable = False
        return encoded


def describe_validation_error(exc: ValidationError) -> str:
    """The first pydantic error as ``field.path[i]: message``."""
    error = exc.errors()[0]
    message = error["msg"].removeprefix("Value error, ")
    return f"{field_path(error['loc'])}: {message}" if error["loc"] else message
