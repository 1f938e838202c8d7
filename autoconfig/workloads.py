"""What the stress client sends: request factories for the DLRM and diffusion applications, and request
templates read from a JSONL workload file for any application.

A ``Workload`` is one HTTP route of an application (``path`` is relative to the app's route prefix) and a
factory of request bodies. Bodies are built once, up front, into a small pool that requests cycle through,
so building them costs nothing while the client measures latency. A ``TemplateWorkload`` sends fixed requests
(``load_workload_file``) in a seeded order whose mix follows their weights.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import yaml

from disagg.api.codec import encode_infer_request
from disagg.config import DLRMAppConfig
from disagg.model_check import check_model
from disagg.signature import DENSE_INPUT, SPARSE_INPUT
from disagg.spec import preset_spec
from disagg.synthetic import SignatureRequests, SyntheticRequests

JSON_HEADERS: Mapping[str, str] = {"content-type": "application/json"}


@dataclass(frozen=True)
class HttpRequest:
    """One request: ``path`` is relative to the application's route prefix."""

    method: str
    path: str
    body: bytes
    headers: Mapping[str, str]


class RequestSource(Protocol):
    """What the stress client drives: the i-th request it sends."""

    def request(self, index: int) -> HttpRequest: ...


@dataclass(frozen=True)
class Workload:
    """``method path`` with body ``body(i)`` for the i-th request."""

    method: str
    path: str
    body: Callable[[int], bytes]
    headers: Mapping[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))

    def request(self, index: int) -> HttpRequest:
        return HttpRequest(self.method, self.path, self.body(index), self.headers)


CYCLE = 4096
"""Slots of a ``TemplateWorkload``'s order (more when some template would otherwise get none)."""


@dataclass(frozen=True)
class TemplateWorkload:
    """Fixed requests mixed by weight: request ``i`` is ``templates[order[i % len(order)]]``.

    ``order`` is a cycle of ``CYCLE`` slots, each template's count its share of the weights (largest remainder
    rounding; at least one slot each), shuffled with ``seed``: the mix of any ``CYCLE`` consecutive requests
    follows the weights to within a slot per template, and the same seed gives the same order.
    """

    templates: tuple[HttpRequest, ...]
    weights: tuple[float, ...]
    seed: int = 0
    order: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.templates or len(self.weights) != len(self.templates):
            raise ValueError("a TemplateWorkload needs templates and one weight for each")
        if not all(math.isfinite(weight) and weight > 0 for weight in self.weights):
            raise ValueError(f"weights must be finite numbers > 0, got {self.weights}")
        relative = np.asarray(self.weights, dtype=float) / max(self.weights)
        share = relative / relative.sum() * CYCLE
        counts = np.floor(share).astype(int)
        counts[np.argsort(counts - share, kind="stable")[: CYCLE - int(counts.sum())]] += 1
        slots = np.repeat(np.arange(len(self.templates)), np.maximum(counts, 1))
        object.__setattr__(self, "order", tuple(np.random.default_rng(self.seed).permutation(slots).tolist()))

    def request(self, index: int) -> HttpRequest:
        return self.templates[self.order[index % len(self.order)]]


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message starts with ``file:line:`` (or ``file:``)."""


METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
TEMPLATE_KEYS = ("method", "path", "headers", "body", "weight")
MAX_TEMPLATES = 10_000
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_CLIENT_HEADERS = ("content-length", "host", "transfer-encoding")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    item: dict[str, Any] = {}
    for key, value in pairs:
        if key in item:
            raise ValueError(f"duplicate key {key!r}")
        item[key] = value
    return item


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _template(line: str) -> tuple[HttpRequest, float]:
    """One template line, parsed; ``ValueError`` naming the key that is wrong."""
    try:
        item = json.loads(line, object_pairs_hook=_json_object, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("not JSON (nested too deeply)") from None
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(item, dict):
        raise ValueError(f"not a JSON object; keys: {', '.join(TEMPLATE_KEYS)}")
    for key in item:
        if key not in TEMPLATE_KEYS:
            raise ValueError(f"unknown key {key!r}; keys: {', '.join(TEMPLATE_KEYS)}")
    method = item.get("method", "POST")
    if not isinstance(method, str) or method.upper() not in METHODS:
        raise ValueError(f"'method' must be one of {', '.join(METHODS)}, got {method!r}")
    if "path" not in item:
        raise ValueError("missing key 'path'")
    path = item["path"]
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"'path' must start with '/', got {path!r}")
    headers = item.get("headers", {})
    if not isinstance(headers, dict):
        raise ValueError("'headers' must be an object of strings")
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"'headers': {name!r} is not a header name")
        if not isinstance(value, str) or re.search(r"[\r\n\0]", value):
            raise ValueError(f"'headers': {name!r} must be a string on one line")
        if name.lower() in _CLIENT_HEADERS:
            raise ValueError(f"'headers': {name!r} is set by the client")
    body = b""
    if item.get("body") is not None:
        body = json.dumps(item["body"]).encode()
        if not any(name.lower() == "content-type" for name in headers):
            headers = {**headers, **JSON_HEADERS}
    weight = item.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= sys.float_info.max:
        raise ValueError(f"'weight' must be a number > 0, got {weight!r}")
    return HttpRequest(method.upper(), path, body, headers), float(weight)


def load_workload_file(path: str | Path, *, seed: int = 0) -> TemplateWorkload:
    """The request templates of a JSONL file, one JSON object a line (blank and ``#`` lines skipped), mixed by
    their ``weight`` (``TemplateWorkload``, seeded with ``seed``); a ``WorkloadError`` naming the file, line and
    key otherwise. The format: docs/AUTOCONFIG.md."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        number = data.count(b"\n", 0, exc.start) + 1
        raise WorkloadError(f"{path}:{number}: not UTF-8 ({exc.reason})") from None
    templates: list[HttpRequest] = []
    weights: list[float] = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(templates) == MAX_TEMPLATES:
            raise WorkloadError(f"{path}:{number}: more than {MAX_TEMPLATES} templates")
        try:
            template, weight = _template(line)
        except ValueError as exc:
            raise WorkloadError(f"{path}:{number}: {exc}") from None
        templates.append(template)
        weights.append(weight)
    if not templates:
        raise WorkloadError(f"{path}: no request templates (one JSON object a line)")
    return TemplateWorkload(tuple(templates), tuple(weights), seed)


def _cycling(pool: list[bytes]) -> Callable[[int], bytes]:
    return lambda index: pool[index % len(pool)]


def dlrm_workload(
    *, preset: str = "tiny", app: Mapping[str, Any] | None = None, model_name: str = "dlrm", rows_per_request: int = 1,
    pool_size: int = 64, seed: int = 0, variable_size: int = 1,
) -> Workload:
    """OIP v2 JSON infer requests of ``rows_per_request`` rows each, ``pool_size`` distinct bodies seeded by ``seed``.

    ``app`` (a DLRM application's args) serving a ``factory`` model: rows of the model's signature
    (``SignatureRequests`` with ``variable_size`` along every variable dimension, ids within the tables
    ``check_model`` finds; a ``ModelError`` naming the key when the model cannot be served). Otherwise synthetic
    Criteo-shaped rows of the app's preset, else of ``preset`` (``SyntheticRequests``, bags of up to
    ``variable_size`` ids).
    """
    if rows_per_request < 1 or pool_size < 1:
        raise ValueError("rows_per_request and pool_size must be >= 1")
    if variable_size < 1:
        raise ValueError(f"variable_size must be >= 1, got {variable_size}")
    config = None if app is None else DLRMAppConfig.model_validate(app)
    batches: Iterator[Mapping[str, torch.Tensor]]
    if config is not None and config.model.factory is not None:
        report = check_model(config)
        requests = SignatureRequests(config.model.signature(), report.id_ranges, seed=seed, variable_size=variable_size)
        batches = (requests.batch(rows_per_request) for _ in range(pool_size))
    else:
        spec = preset_spec(str(config.model.preset) if config is not None else preset)
        synthetic = SyntheticRequests(spec, seed=seed, max_hotness=variable_size)
        batches = (dict(zip((DENSE_INPUT, SPARSE_INPUT), synthetic.batch(rows_per_request), strict=True))
                   for _ in range(pool_size))
    pool = [encode_infer_request(inputs).model_dump_json(exclude_none=True).encode() for inputs in batches]
    return Workload("POST", f"/models/{model_name}/infer", _cycling(pool))


def diffusion_workload(
    *, model: str | None = None, size: str | None = "32x32", steps: int = 4, n: int = 1, pool_size: int = 16,
    controlnets: str | None = None, loras: str | None = None,
) -> Workload:
    """OpenAI ``/v1/images/generations`` requests: small images, few steps, a distinct seed and prompt each;
    ``controlnets`` (names joined by ``+``) conditions each request on those ControlNets with a white square on
    black; ``loras`` lists LoRA combinations (names joined by ``+``) separated by ``|``, request ``i`` of the pool
    taking combination ``i`` modulo their count (an empty combination: no LoRA), each LoRA at scale 1."""
    if steps < 1 or n < 1 or pool_size < 1:
        raise ValueError("steps, n and pool_size must be >= 1")
    combinations = [[{"name": name, "scale": 1.0} for name in combination.split("+") if name]
                    for combination in str(loras or "").split("|")]
    base: dict[str, Any] = {"num_inference_steps": steps, "n": n}
    if model is not None:
        base["model"] = model
    if size is not None:
        base["size"] = size
    if controlnets:
        from serving.controlnet.conditioning import encode_image  # diffusers: only when ControlNets are asked for

        square = np.zeros((64, 64, 3), np.uint8)
        square[16:48, 16:48] = 255
        image = encode_image(square)
        base["controlnets"] = [{"name": name, "image": image} for name in str(controlnets).split("+")]
    pool = [json.dumps({**base, "prompt": f"a small red cube, view {i}", "seed": i,
                        "loras": combinations[i % len(combinations)]}).encode() for i in range(pool_size)]
    return Workload("POST", "/v1/images/generations", _cycling(pool))


def parse_workload_options(text: str | None) -> dict[str, Any]:
    """``"rows_per_request=32,seed=1"`` -> ``{"rows_per_request": 32, "seed": 1}`` (values read as YAML scalars)."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"workload option {item!r}: expected KEY=VALUE")
        options[key.strip()] = yaml.safe_load(value.strip())
    return options


def workload_for_app(
    import_path: str, args: Mapping[str, Any] | None, options: Mapping[str, Any] | None = None
) -> Workload:
    """The workload of a Serve application, read from its ``import_path`` and ``args`` (a DLRM app serving a
    ``factory`` model: requests of its signature); ``options`` override the factory's keyword arguments
    (``dlrm_workload`` or ``diffusion_workload``), an unknown one is an error naming it."""
    args = args or {}
    model = args.get("model") or {}
    if import_path == "disagg.app:build_app":
        factory: Callable[..., Workload] = dlrm_workload
        served = {"app": args} if model.get("factory") else {"preset": model.get("preset") or "tiny"}
        defaults: dict[str, Any] = {**served, "model_name": args.get("model_name", "dlrm")}
    elif import_path == "serving.app:build_app":
        factory, defaults = diffusion_workload, {"model": model.get("name")}
    elif import_path == "serving.app:build_multi_app":  # the default (first) model, which the shortcuts tune
        from autoconfig.knobs import default_model_name

        factory, defaults = diffusion_workload, {"model": default_model_name(args)}
    else:
        raise ValueError(f"no workload for import_path {import_path!r}; known: disagg.app:build_app, "
                         "serving.app:build_app, serving.app:build_multi_app")
    known = [name for name in inspect.signature(factory).parameters]
    for name in options or {}:
        if name not in known:
            raise ValueError(f"workload option {name!r} is not one of {factory.__name__}'s: {', '.join(known)}")
    return factory(**(defaults | dict(options or {})))
