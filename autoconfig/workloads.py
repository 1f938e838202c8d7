"""What the stress client sends: request factories for the DLRM and diffusion applications.

A ``Workload`` is one HTTP route of an application (``path`` is relative to the app's route prefix) and a
factory of request bodies. Bodies are built once, up front, into a small pool that requests cycle through,
so building them costs nothing while the client measures latency.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from disagg.api.codec import encode_dlrm_request
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests

JSON_HEADERS: Mapping[str, str] = {"content-type": "application/json"}


@dataclass(frozen=True)
class Workload:
    """``method path`` with body ``body(i)`` for the i-th request."""

    method: str
    path: str
    body: Callable[[int], bytes]
    headers: Mapping[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))


def _cycling(pool: list[bytes]) -> Callable[[int], bytes]:
    return lambda index: pool[index % len(pool)]


def dlrm_workload(
    *, preset: str = "tiny", model_name: str = "dlrm", rows_per_request: int = 1, pool_size: int = 64, seed: int = 0
) -> Workload:
    """OIP v2 JSON infer requests of ``rows_per_request`` synthetic Criteo-shaped rows each."""
    if rows_per_request < 1 or pool_size < 1:
        raise ValueError("rows_per_request and pool_size must be >= 1")
    requests = SyntheticRequests(preset_spec(preset), seed=seed)
    pool = [
        encode_dlrm_request(*requests.batch(rows_per_request)).model_dump_json(exclude_none=True).encode()
        for _ in range(pool_size)
    ]
    return Workload("POST", f"/models/{model_name}/infer", _cycling(pool))


def diffusion_workload(
    *, model: str | None = None, size: str | None = "32x32", steps: int = 4, n: int = 1, pool_size: int = 16
) -> Workload:
    """OpenAI ``/v1/images/generations`` requests: small images, few steps, a distinct seed and prompt each."""
    if steps < 1 or n < 1 or pool_size < 1:
        raise ValueError("steps, n and pool_size must be >= 1")
    base: dict[str, Any] = {"num_inference_steps": steps, "n": n}
    if model is not None:
        base["model"] = model
    if size is not None:
        base["size"] = size
    pool = [json.dumps({**base, "prompt": f"a small red cube, view {i}", "seed": i}).encode() for i in range(pool_size)]
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
    """The workload of a Serve application, read from its ``import_path`` and ``args``; ``options`` override the
    factory's keyword arguments (``dlrm_workload`` or ``diffusion_workload``), an unknown one is an error naming it."""
    args = args or {}
    model = args.get("model") or {}
    if import_path == "disagg.app:build_app":
        factory: Callable[..., Workload] = dlrm_workload
        defaults: dict[str, Any] = {"preset": model.get("preset", "tiny"), "model_name": args.get("model_name", "dlrm")}
    elif import_path == "serving.app:build_app":
        factory, defaults = diffusion_workload, {"model": model.get("name")}
    else:
        raise ValueError(f"no workload for import_path {import_path!r}; known: disagg.app:build_app, "
                         "serving.app:build_app")
    known = [name for name in inspect.signature(factory).parameters]
    for name in options or {}:
        if name not in known:
            raise ValueError(f"workload option {name!r} is not one of {factory.__name__}'s: {', '.join(known)}")
    return factory(**(defaults | dict(options or {})))
