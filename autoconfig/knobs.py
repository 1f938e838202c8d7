"""Knob values written into a Ray Serve config: what a configuration means for a deployment.

``apply_knobs`` sets ``max_batch_size``, ``batch_wait_timeout_s``, ``device_share``, ``num_replicas`` and optionally
``torch_threads`` on the deployment holding an application's model (``APP_KNOBS``); what each knob sets and what
that enforces is in docs/AUTOCONFIG.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from ray.serve.schema import ServeDeploySchema

from autoconfig.serve_config import validate_app_args

Accelerator = Literal["cpu", "gpu"]
CUDA_MEMORY_FRACTION_ENV = "SWIFTSERVE_CUDA_MEMORY_FRACTION"
CPU_SHARE_ENV = "SWIFTSERVE_CPU_SHARE"
MPS_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


class Knobs(BaseModel):
    """A validated configuration; an unknown knob is an error naming it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(ge=1)
    batch_wait_timeout_s: float = Field(ge=0.0, le=10.0)
    device_share: float = Field(gt=0.0)
    num_replicas: int = Field(ge=1)
    torch_threads: int | None = Field(None, ge=1)

    @property
    def resources(self) -> float:
        """Device share of the whole deployment: share per replica x replicas."""
        return self.device_share * self.num_replicas


@dataclass(frozen=True)
class AppKnobs:
    """Where one application (by ``import_path``) takes the knobs.

    ``target`` names the deployment holding the model (from the app's ``args``); ``user_config`` is the live
    batching configuration of that deployment; ``max_ongoing`` maps deployment names to their
    ``max_ongoing_requests`` (the target's name is passed in); ``threads`` is a key path under ``args``.
    """

    target: Callable[[Mapping[str, Any]], str]
    user_config: Callable[[Knobs], dict[str, Any]]
    max_ongoing: Callable[[Knobs, str], dict[str, int]]
    threads: tuple[str, ...]


APP_KNOBS: Mapping[str, AppKnobs] = {
    "disagg.app:build_app": AppKnobs(
        target=lambda args: "MonolithicDLRM" if args.get("serving") == "monolithic" else "DisaggregatedDLRM",
        user_config=lambda knobs: {"max_batch_size": knobs.max_batch_size,
                                   "batch_wait_timeout_s": knobs.batch_wait_timeout_s},
        max_ongoing=lambda knobs, target: {target: 2 * knobs.max_batch_size},
        threads=("model", "torch_threads"),
    ),
    "serving.app:build_app": AppKnobs(
        target=lambda args: "DiffusionModel",
        user_config=lambda knobs: {"max_batch_rows": knobs.max_batch_size},
        max_ongoing=lambda knobs, target: {
            target: 2 * knobs.max_batch_size,
            "ImagesIngress": 2 * knobs.max_batch_size * knobs.num_replicas,
        },
        threads=("model", "torch_threads"),
    ),
}


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _deployment(app: dict[str, Any], name: str) -> dict[str, Any]:
    deployments = app.setdefault("deployments", [])
    found = next((deployment for deployment in deployments if deployment["name"] == name), None)
    if found is None:
        found = {"name": name}
        deployments.append(found)
    return found


def apply_knobs(
    app: Mapping[str, Any],
    configuration: Mapping[str, float | int],
    *,
    accelerator: Accelerator = "cpu",
    mps: bool = False,
) -> dict[str, Any]:
    """A copy of ``app`` (a Serve application config as a dict) set to ``configuration``.

    Raises ``ValueError`` for an ``import_path`` without knobs or a GPU share above 1 that is not whole.
    """
    knobs = Knobs.model_validate(dict(configuration))
    mapping = APP_KNOBS.get(app.get("import_path", ""))
    if mapping is None:
        raise ValueError(f"import_path {app.get('import_path')!r} has no knobs; known: {', '.join(APP_KNOBS)}")
    app = copy.deepcopy(dict(app))
    args = app.setdefault("args", {})
    target_name = mapping.target(args)
    target = _deployment(app, target_name)
    target.pop("autoscaling_config", None)
    target["num_replicas"] = knobs.num_replicas
    target["user_config"] = mapping.user_config(knobs)
    for name, limit in mapping.max_ongoing(knobs, target_name).items():
        _deployment(app, name)["max_ongoing_requests"] = limit
    actor = target.setdefault("ray_actor_options", {})
    env: dict[str, str] = {}
    threads = knobs.torch_threads
    if accelerator == "cpu":
        actor["num_cpus"] = knobs.device_share
        env[CPU_SHARE_ENV] = str(knobs.device_share)  # the replica enforces it (serving.common.cpu_share)
        threads = threads or max(1, round(knobs.device_share))
    else:
        if knobs.device_share > 1 and not float(knobs.device_share).is_integer():
            raise ValueError(f"device_share {knobs.device_share} on GPU: above 1 it must be a whole number of GPUs")
        actor["num_gpus"] = knobs.device_share
        fraction = min(knobs.device_share, 1.0)
        env[CUDA_MEMORY_FRACTION_ENV] = str(fraction)
        if mps:
            env[MPS_PERCENTAGE_ENV] = str(max(1, round(100 * fraction)))
    if threads is not None:
        _set(args, mapping.threads, threads)
    if env:
        actor.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(env)
    return app


def configure_serve_config(
    config: ServeDeploySchema,
    app_name: str,
    configuration: Mapping[str, float | int],
    *,
    accelerator: Accelerator = "cpu",
    mps: bool = False,
) -> ServeDeploySchema:
    """``config`` with application ``app_name`` set to ``configuration``, validated as ``load_serve_config`` does."""
    raw = config.model_dump(exclude_unset=True)
    names = [app["name"] for app in raw["applications"]]
    if app_name not in names:
        raise ValueError(f"no application {app_name!r} in the Serve config; it has: {', '.join(names)}")
    index = names.index(app_name)
    raw["applications"][index] = apply_knobs(
        raw["applications"][index], configuration, accelerator=accelerator, mps=mps
    )
    configured = ServeDeploySchema.model_validate(raw)
    validate_app_args(configured.applications[index])
    return configured


def write_serve_config(config: ServeDeploySchema, path: str | Path) -> None:
    """Write ``config`` as a YAML file for ``serve deploy`` / ``autoconfig check`` (only the fields set)."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True), sort_keys=False))
