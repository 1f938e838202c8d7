"""The search space: each knob a finite list of values, so every configuration can be enumerated.

A knob is either a shortcut of the built-in applications (``max_batch_size``, ``device_share``, ``num_replicas``:
all three or none; optional ``batch_wait_timeout_s``, which only the DLRM app reads, and ``torch_threads``) or a
dotted path into one of the application's deployment entries (``Model.user_config.max_batch_size``,
``Model.ray_actor_options.num_cpus``).
``SearchSpace`` is read from a YAML space file (format: docs/AUTOCONFIG.md); errors name the field
(``knobs.max_batch_size.values[2]: ...``). ``encode`` maps a configuration into ``[0, 1]^d`` for model-based
searchers.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from serving.common.http import field_path

MAX_SPACE_SIZE = 100_000
SPACES_DIR = Path(__file__).parent / "spaces"
KNOB_NAMES = ("max_batch_size", "batch_wait_timeout_s", "device_share", "num_replicas", "torch_threads")
REQUIRED_SHORTCUTS = ("max_batch_size", "device_share", "num_replicas")
#: knob (or a dotted path's last part) -> offset added before the log of the default ``log`` scale
_LOG_KNOBS = {"max_batch_size": 0.0, "batch_wait_timeout_s": 1e-3}
#: ``Deployment.option[.key...]``: a deployment name (or pattern, or ``args``) without dots, then identifiers
_DOTTED = re.compile(r"^[^.\s]+(\.[A-Za-z_][A-Za-z0-9_]*)+$")

KnobValue = int | float | str | bool


class SpaceError(ValueError):
    """An invalid space file or configuration; the message names the field."""


class Configuration(Mapping[str, KnobValue]):
    """One point of a search space: knob name -> value, immutable and hashable (equal to a dict of the same
    items)."""

    __slots__ = ("_hash", "_values")

    def __init__(self, values: Mapping[str, KnobValue] | None = None, /, **knobs: KnobValue) -> None:
        self._values = {**(values or {}), **knobs}
        self._hash = hash(frozenset(self._values.items()))

    def __getitem__(self, name: str) -> KnobValue:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Configuration({self._values!r})"

    def as_dict(self) -> dict[str, KnobValue]:
        """Knob -> value, a plain dict."""
        return dict(self._values)


def _configuration_from_data(data: Any) -> Configuration:
    if isinstance(data, Configuration):
        return data
    return Configuration(_PLAIN_CONFIGURATION.validate_python(data))


_PLAIN_CONFIGURATION = TypeAdapter(dict[str, StrictBool | StrictInt | StrictFloat | StrictStr])
#: A configuration as a field of a pydantic model (bank files, studies): read from and written as a JSON object.
ConfigurationField = Annotated[
    Configuration, PlainValidator(_configuration_from_data), PlainSerializer(lambda config: config.as_dict())
]


class _Knob(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    values: tuple[Any, ...]
    scale: Literal["linear", "log"] | None = None

    @field_validator("values")
    @classmethod
    def _unique_sorted(cls, values: tuple[Any, ...]) -> tuple[Any, ...]:
        seen: set[Any] = set()
        for value in values:
            if value in seen:
                raise ValueError(f"duplicate value {value}")
            seen.add(value)
        numeric = [not isinstance(v, (str, bool)) for v in values]
        if all(numeric):
            return tuple(sorted(values))
        if any(numeric):
            raise ValueError("values must be all numbers or all strings and booleans")
        return values  # categories keep the file's order

    @model_validator(mode="after")
    def _log_needs_positive_numbers(self) -> _Knob:
        if self.scale == "log" and any(isinstance(v, (str, bool)) or v <= 0 for v in self.values):
            raise ValueError("scale log needs values that are numbers > 0")
        return self


class _CountKnob(_Knob):
    values: tuple[Annotated[StrictInt, Field(ge=1, le=65_536)], ...] = Field(min_length=1)


class _TimeoutKnob(_Knob):
    values: tuple[Annotated[float, Field(ge=0.0, le=10.0)], ...] = Field(min_length=1)


class _ShareKnob(_Knob):
    values: tuple[Annotated[float, Field(gt=0.0, le=1024.0)], ...] = Field(min_length=1)


class _PathKnob(_Knob):
    """A dotted-path knob: any JSON scalars (Serve checks the values against the app's config)."""

    values: tuple[StrictBool | StrictInt | StrictFloat | StrictStr, ...] = Field(min_length=1, max_length=1024)


_SHORTCUT_KNOBS: dict[str, type[_Knob]] = {
    "max_batch_size": _CountKnob,  # most requests merged into one forward pass
    "batch_wait_timeout_s": _TimeoutKnob,  # seconds the first request of a batch waits
    "device_share": _ShareKnob,  # CPUs per replica on CPU, fraction of one GPU on GPU
    "num_replicas": _CountKnob,  # replicas of the model deployment
    "torch_threads": _CountKnob,  # torch intra-op threads per replica
}


def is_path_knob(name: str) -> bool:
    """Whether ``name`` is a dotted path into a deployment entry (not a shortcut)."""
    return name not in _SHORTCUT_KNOBS


def shortcut_values(configuration: Mapping[str, Any]) -> dict[str, Any]:
    """The shortcut knobs of ``configuration`` and their values (empty for a space of dotted paths only)."""
    return {name: value for name, value in configuration.items() if not is_path_knob(name)}


def _parse_knobs(raw: Any) -> dict[str, _Knob]:
    if not isinstance(raw, Mapping):
        raise ValueError("knobs: must be a mapping of knob name to {values: [...]}")
    knobs: dict[str, _Knob] = {}
    for name, spec in raw.items():
        model = _SHORTCUT_KNOBS.get(name)
        if model is None:
            if not isinstance(name, str) or not _DOTTED.match(name):
                raise ValueError(f"knobs.{name}: not a knob; use {', '.join(KNOB_NAMES)} or a dotted path "
                                 "Deployment.option[.key] (e.g. Model.user_config.max_batch_size)")
            model = _PathKnob
        try:
            knobs[name] = model.model_validate(spec)
        except ValidationError as exc:
            separator = "." if exc.errors()[0]["loc"] else ": "
            raise ValueError(f"knobs.{name}{separator}{describe_validation_error(exc)}".replace(".[", "[")) from None
    shortcuts = [name for name in knobs if not is_path_knob(name)]
    missing = [name for name in REQUIRED_SHORTCUTS if name not in knobs]
    if shortcuts and missing:
        raise ValueError(f"knobs.{missing[0]}: Field required (the shortcuts {', '.join(REQUIRED_SHORTCUTS)} come "
                         "together)")
    if not knobs:
        raise ValueError("knobs: at least one knob is needed")
    ordered = [name for name in KNOB_NAMES if name in knobs] + [name for name in knobs if is_path_knob(name)]
    return {name: knobs[name] for name in ordered}


class SearchSpace(BaseModel):
    """A finite grid of configurations; the objective (a rate, >= 0) is maximised."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    knobs: Annotated[dict[str, _Knob], PlainValidator(_parse_knobs), PlainSerializer(
        lambda knobs: {name: knob.model_dump(mode="json", exclude_none=True) for name, knob in knobs.items()})]
    max_total_share: float | None = Field(
        None, gt=0.0, description="Configurations whose total share (replicas x share per replica, summed over "
        "the deployments whose two are knobs) is above this are left out."
    )
    max_replicas: int | None = Field(
        None, ge=1, description="Configurations whose replicas (num_replicas plus every Deployment.num_replicas "
        "knob) add up to more than this are left out."
    )

    @model_validator(mode="after")
    def _bounded(self) -> SearchSpace:
        grid = math.prod(len(self.values(name)) for name in self.knob_names)
        if grid > MAX_SPACE_SIZE:
            raise ValueError(f"knobs: {grid} combinations, more than the limit of {MAX_SPACE_SIZE}")
        if self.max_replicas is not None and not self._replica_knobs:
            raise ValueError("max_replicas: needs num_replicas or a Deployment.num_replicas knob")
        if self.max_total_share is not None and not self._share_pairs:
            raise ValueError("max_total_share: needs device_share and num_replicas, or a deployment's num_replicas "
                             "and ray_actor_options.num_cpus (or num_gpus), as knobs")
        if not self.configurations():
            limit = "max_total_share" if self.max_total_share is not None else "max_replicas"
            raise ValueError(f"{limit}: {getattr(self, limit)} leaves no configuration")
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
        """The knobs this space has, in enumeration order: the shortcuts, then the dotted paths as written."""
        return tuple(self.knobs)

    @property
    def path_knobs(self) -> tuple[str, ...]:
        """The dotted-path knobs."""
        return tuple(name for name in self.knobs if is_path_knob(name))

    @property
    def has_shortcuts(self) -> bool:
        return "device_share" in self.knobs

    @property
    def size(self) -> int:
        return len(self.configurations())

    def configurations(self) -> tuple[Configuration, ...]:
        """Every configuration, in a fixed order (the last knob varies fastest; values in :meth:`values` order)."""
        return self._configurations

    def index(self, config: Mapping[str, Any]) -> int:
        """Position of ``config`` in :meth:`configurations`."""
        try:
            return self._index[config if isinstance(config, Configuration) else Configuration(config)]
        except (KeyError, TypeError):
            unknown = sorted(set(config) - set(self.knobs))
            missing = sorted(set(self.knobs) - set(config))
            why = (f"unknown knob {unknown[0]!r}" if unknown else f"no value for knob {missing[0]!r}" if missing
                   else "not in the search space")
            raise SpaceError(f"configuration {dict(config)}: {why}") from None

    def configuration(self, values: Mapping[str, Any]) -> Configuration:
        """The space's own configuration equal to ``values`` (e.g. read back from JSON or Optuna, where 4 may be
        4.0)."""
        return self._configurations[self.index(values)]

    def total_share(self, config: Mapping[str, Any]) -> float | None:
        """Replicas x share per replica, summed over the deployments whose two are knobs; None if none is."""
        if not self._share_pairs:
            return None
        return sum(float(config[replicas]) * float(config[share]) for replicas, share in self._share_pairs)

    def encode(self, config: Mapping[str, Any]) -> np.ndarray:
        """``config`` as a point of ``[0, 1]^d``, one coordinate per knob (:meth:`coordinates`)."""
        return self.encode_all()[self.index(config)]

    def encode_all(self) -> np.ndarray:
        """Encoding of every configuration, shape ``(size, d)``, rows in enumeration order (read-only)."""
        return self._encoded

    def values(self, name: str) -> tuple[KnobValue, ...]:
        """The values of knob ``name``: numbers ascending, strings and booleans in the file's order."""
        return self.knobs[name].values

    def coordinates(self, name: str) -> np.ndarray:
        """The encoded coordinate in ``[0, 1]`` of each value of knob ``name``, min-max scaled: numbers after
        ``log(v)`` on a ``log`` scale (the default for ``max_batch_size``, and ``log(v + 1 ms)`` for
        ``batch_wait_timeout_s``, also as a dotted path's last part), linear otherwise; categories by position."""
        knob, values = self.knobs[name], self.values(name)
        if any(isinstance(value, (str, bool)) for value in values):
            scaled = np.arange(len(values), dtype=np.float64)
        else:
            scaled = np.array(values, dtype=np.float64)
            default_log = name.rsplit(".", 1)[-1] in _LOG_KNOBS
            if knob.scale == "log" or (knob.scale is None and default_log):
                offset = _LOG_KNOBS.get(name.rsplit(".", 1)[-1], 0.0) if knob.scale is None else 0.0
                scaled = np.log(scaled + offset)
        span = scaled[-1] - scaled[0]
        return (scaled - scaled[0]) / span if span > 0 else np.full_like(scaled, 0.5)

    def total_replicas(self, config: Mapping[str, Any]) -> int:
        """``num_replicas`` plus every ``Deployment.num_replicas`` knob of ``config`` (a pattern counts once)."""
        return sum(int(config[name]) for name in self._replica_knobs)

    @cached_property
    def _replica_knobs(self) -> tuple[str, ...]:
        return tuple(name for name in self.knobs if name == "num_replicas" or (
            name.endswith(".num_replicas") and name.count(".") == 1 and not name.startswith("args.")))

    @cached_property
    def _share_pairs(self) -> tuple[tuple[str, str], ...]:
        """(replicas knob, share-per-replica knob) of each deployment that has both as knobs."""
        pairs = [("num_replicas", "device_share")] if self.has_shortcuts else []
        for name in self.path_knobs:
            deployment, _, option = name.partition(".")
            if option in ("ray_actor_options.num_cpus", "ray_actor_options.num_gpus") and (
                    f"{deployment}.num_replicas" in self.knobs):
                pairs.append((f"{deployment}.num_replicas", name))
        return tuple(pairs)

    @cached_property
    def _configurations(self) -> tuple[Configuration, ...]:
        names = self.knob_names
        configs = (
            Configuration(dict(zip(names, combo, strict=True)))
            for combo in itertools.product(*(self.values(name) for name in names))
        )
        share_limit = math.inf if self.max_total_share is None else self.max_total_share + 1e-9
        replica_limit = math.inf if self.max_replicas is None else self.max_replicas
        if math.isinf(share_limit) and math.isinf(replica_limit):
            return tuple(configs)
        return tuple(c for c in configs if (math.isinf(share_limit) or self.total_share(c) <= share_limit)
                     and self.total_replicas(c) <= replica_limit)

    @cached_property
    def _index(self) -> dict[Configuration, int]:
        return {config: i for i, config in enumerate(self._configurations)}

    @cached_property
    def _encoded(self) -> np.ndarray:
        columns = []
        for name in self.knob_names:
            position = {value: i for i, value in enumerate(self.values(name))}
            indices = [position[config[name]] for config in self._configurations]
            columns.append(self.coordinates(name)[indices])
        encoded = np.stack(columns, axis=1)
        encoded.flags.writeable = False
        return encoded


def describe_validation_error(exc: ValidationError) -> str:
    """The first pydantic error as ``field.path[i]: message``."""
    error = exc.errors()[0]
    message, path = error["msg"].removeprefix("Value error, "), field_path(error["loc"])
    if not path:
        return message
    last = str(error["loc"][-1])
    if message.startswith((f"{last}.", f"{last}:")):  # a validator that named the field itself
        return path[: len(path) - len(last)] + message
    return f"{path}: {message}"
