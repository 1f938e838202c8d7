"""The load test's own command-line options and their parsed form, ``Settings``.

Each option is also an environment variable (``LOCUST_`` + its name in capitals, ``--zipf-s`` is ``LOCUST_ZIPF_S``)
and a key of a Locust config file. Locust keeps them as validated *text* in ``environment.parsed_options`` (the
web UI edits them as text too); ``Settings.from_options`` parses that text, so users, the step shape and the gates
all read one typed view. The defaults match `make serve` (deploy/serve_config.yaml).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

USER_KINDS = ("diffusion", "dlrm")
_SIZE = re.compile(r"^[1-9][0-9]*x[1-9][0-9]*$")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _fail(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def names(text: str) -> tuple[str, ...]:
    """``"a,b,c"`` -> ``("a", "b", "c")``, most popular first; ``""`` or ``"none"`` -> no names; ``"*"`` -> all
    that the server lists in ``GET /v1/models`` (alphabetical, so the first listed is the most popular)."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    if items in ((), ("none",)):
        return ()
    if items == ("*",):
        return items
    for item in items:
        if not _NAME.match(item):
            raise _fail(f"{item!r} is not a ControlNet/LoRA name (letters, digits, . _ -)")
    if len(set(items)) != len(items):
        raise _fail(f"{text!r} names one item twice")
    return items


def count_range(text: str) -> tuple[int, int]:
    """``"0-1"`` -> ``(0, 1)``, ``"2"`` -> ``(2, 2)``: how many of an add-on kind one request carries."""
    low, sep, high = text.strip().partition("-")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise _fail(f"{text!r}: expected N or MIN-MAX, e.g. 0-1") from None
    if bounds[0] < 0 or bounds[0] > bounds[1]:
        raise _fail(f"{text!r}: expected 0 <= MIN <= MAX")
    return bounds


def user_mix(text: str) -> dict[str, float] | None:
    """``"diffusion,dlrm"`` or ``"diffusion=1,dlrm=3"`` -> weight per user kind (kinds left out are not run);
    ``""`` -> None: every kind, equal weights."""
    mix: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, weight = item.partition("=")
        kind = kind.strip()
        if kind not in USER_KINDS:
            raise _fail(f"unknown user kind {kind!r}; known: {', '.join(USER_KINDS)}")
        try:
            mix[kind] = float(weight) if sep else 1.0
        except ValueError:
            raise _fail(f"{item!r}: weight must be a number") from None
        if not mix[kind] > 0:
            raise _fail(f"{item!r}: weight must be > 0 (leave the kind out instead)")
    return mix or None


def size(text: str) -> str:
    if not _SIZE.match(text.strip()):
        raise _fail(f"{text!r}: expected WIDTHxHEIGHT, e.g. 32x32")
    return text.strip()


def threshold(text: str) -> float | None:
    """A gate threshold; ``off`` (or ``none``, or empty) disables the gate."""
    if text.strip().lower() in ("", "off", "none"):
        return None
    return number(float, minimum=0.0)(text)


def number(kind: type, *, minimum: float | None = None, above: float | None = None) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise _fail(f"{text!r} is not a valid {kind.__name__}") from None
        if minimum is not None and value < minimum:
            raise _fail(f"{text!r}: must be >= {minimum:g}")
        if above is not None and not value > above:
            raise _fail(f"{text!r}: must be > {above:g}")
        return value

    return parse


def optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Empty text -> None; otherwise ``parse``."""
    return lambda text: parse(text) if text.strip() else None


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip() not in allowed:
            raise _fail(f"{text!r}: expected one of {', '.join(allowed)}")
        return text.strip()

    return parse


def text(value: str) -> str:
    return value.strip()


@dataclass(frozen=True)
class Option:
    field: str
    default: str  # as text, the way it is given on the command line
    parse: Callable[[str], Any]
    help: str
    secret: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


_positive_int, _positive_float = number(int, above=0), number(float, above=0.0)
OPTIONS = (
    Option("user_mix", "", user_mix, "User kinds to run and their weights: 'diffusion,dlrm' or 'diffusion=1,dlrm=3' "
           "(empty: every kind, equal weights; locust's positional class names also select)."),
    Option("seed", "0", number(int), "Base seed: each user draws add-ons, prompts and image seeds from its own "
           "generator seeded with this and its number."),
    Option("min_wait", "0.1", number(float, minimum=0.0), "Shortest think time between a user's requests (s)."),
    Option("max_wait", "1.0", number(float, minimum=0.0), "Longest think time between a user's requests (s)."),
    Option("request_timeout", "120", _positive_float, "HTTP timeout of one request (s)."),
    Option("api_key", "", optional(text), "Bearer token sent with every request (default: $SWIFTSERVE_API_KEY, "
           "the server's own).", secret=True),
    Option("diffusion_prefix", "", text, "Route prefix of the diffusion app ('' for `make serve`)."),
    Option("diffusion_model", "", optional(text), "`model` field of image requests (empty: the served model)."),
    Option("diffusion_size", "32x32", size, "Image size WIDTHxHEIGHT."),
    Option("diffusion_steps", "2", _positive_int, "num_inference_steps of each image request."),
    Option("diffusion_n", "1", _positive_int, "Images per request (n)."),
    Option("controlnets", "edges", names, "ControlNet names, most requested first (Zipf ranks); 'none' for none, "
           "'*' for all that GET /v1/models lists."),
    Option("controlnets_per_request", "0-1", count_range, "ControlNets per request: N or MIN-MAX, uniform."),
    Option("controlnet_preprocess", "none", choice("none", "canny"),
           "Detector the server runs on the control image: none or canny."),
    Option("loras", "none", names, "LoRA names, most requested first (Zipf ranks, a long tail); 'none' for none, "
           "'*' for all that GET /v1/models lists."),
    Option("loras_per_request", "0-1", count_range, "LoRAs per request: N or MIN-MAX, uniform."),
    Option("lora_scale", "0.8", number(float), "Scale of every requested LoRA."),
    Option("zipf_s", "1.1", _positive_float, "Zipf exponent s: the add-on of popularity rank r is drawn with "
           "weight r^-s."),
    Option("dlrm_serve_config", "", optional(text), "Serve config file the server runs (e.g. "
           "deploy/serve_config.yaml): requests follow the model of its app --dlrm-app (a preset's or a factory "
           "model's signature), sent to that app's route prefix and model name (empty: --dlrm-preset, --dlrm-prefix "
           "and --dlrm-model)."),
    Option("dlrm_app", "dlrm", text, "Application of --dlrm-serve-config the DLRM requests go to."),
    Option("dlrm_prefix", "/v2", text, "Route prefix of the DLRM app (without --dlrm-serve-config)."),
    Option("dlrm_model", "dlrm", text, "Model name in /v2/models/{name}/infer (without --dlrm-serve-config)."),
    Option("dlrm_preset", "tiny", text, "DLRM preset the server runs, which bounds the synthetic ids (without "
           "--dlrm-serve-config)."),
    Option("dlrm_rows", "16", _positive_int, "Rows (samples) per infer request."),
    Option("dlrm_pool", "64", _positive_int, "Distinct pre-built infer bodies each DLRM user cycles through."),
    Option("dlrm_variable_size", "1", _positive_int, "Size of every variable dimension of the DLRM model's inputs "
           "(ids per bag, history length; a preset's bags hold up to this many ids)."),
    Option("step_users", "0", number(int, minimum=0), "Step load shape: users added every step (0: off; then "
           "--users/--spawn-rate/--run-time apply)."),
    Option("step_seconds", "10", _positive_float, "Step load shape: seconds per step."),
    Option("step_count", "3", _positive_int, "Step load shape: number of steps; the test stops after the last."),
    Option("step_spawn_rate", "", optional(_positive_float), "Step load shape: users started per second (empty: "
           "a step's users in one second)."),
    Option("max_failure_ratio", "0.01", threshold, "Gate: failed / all requests must not exceed this ('off' "
           "disables)."),
    Option("max_p95_ms", "off", threshold, "Gate: p95 response time (ms), overall and of every request name, must "
           "not exceed this ('off' disables)."),
)


def _validated(option: Option) -> Callable[[str], str]:
    """argparse ``type``: refuses bad text at startup with a usage error, keeps the text itself."""

    def check(value: str) -> str:
        option.parse(value)
        return value

    check.__name__ = option.field
    return check


@dataclass(frozen=True)
class Settings:
    """Every option, parsed (see OPTIONS for their meaning and defaults)."""

    user_mix: dict[str, float] | None
    seed: int
    min_wait: float
    max_wait: float
    request_timeout: float
    api_key: str | None
    diffusion_prefix: str
    diffusion_model: str | None
    diffusion_size: str
    diffusion_steps: int
    diffusion_n: int
    controlnets: tuple[str, ...]
    controlnets_per_request: tuple[int, int]
    controlnet_preprocess: str
    loras: tuple[str, ...]
    loras_per_request: tuple[int, int]
    lora_scale: float
    zipf_s: float
    dlrm_serve_config: str | None
    dlrm_app: str
    dlrm_prefix: str
    dlrm_model: str
    dlrm_preset: str
    dlrm_rows: int
    dlrm_pool: int
    dlrm_variable_size: int
    step_users: int
    step_seconds: float
    step_count: int
    step_spawn_rate: float | None
    max_failure_ratio: float | None
    max_p95_ms: float | None

    @property
    def step_enabled(self) -> bool:
        return self.step_users > 0

    @classmethod
    def from_options(cls, options: Any = None) -> Settings:
        """From locust's ``environment.parsed_options``; None (locust as a library) or a missing option: defaults.
        Text is parsed; a value of another type (set from Python) is taken as it is."""
        values = {}
        for option in OPTIONS:
            raw = getattr(options, option.field, None) if options is not None else None
            raw = option.default if raw is None else raw
            values[option.field] = option.parse(raw) if isinstance(raw, str) else raw
        if not values["api_key"]:  # the server's own variable, read here so it never shows in --help or the UI
            values["api_key"] = os.environ.get("SWIFTSERVE_API_KEY", "").strip() or None
        return cls(**values)


assert [option.field for option in OPTIONS] == [f.name for f in fields(Settings)], "OPTIONS and Settings differ"


def add_arguments(parser: Any) -> None:
    """Listener of ``events.init_command_line_parser``: registers OPTIONS (shown in the web UI too)."""
    for option in OPTIONS:
        parser.add_argument(option.flag, dest=option.field, default=option.default, type=_validated(option),
                            env_var="LOCUST_" + option.field.upper(), help=option.help, is_secret=option.secret)
