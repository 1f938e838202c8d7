"""Knob values written into a Ray Serve config: what a configuration means for a deployment.

A configuration maps knob names to values: ``max_batch_size``, ``batch_wait_timeout_s``, ``device_share``,
``num_replicas`` and optionally ``torch_threads``. ``apply_knobs`` writes them into one application of a Serve
config (the dict form of a ``ServeApplicationSchema``); the *target* deployment is the one holding the model:
``DiffusionModel`` (diffusion), ``MonolithicDLRM`` or the dense ``DisaggregatedDLRM`` (DLRM; embedding shards
keep the template's resources).

What each knob sets, and what that enforces:

- ``num_replicas``: the target's ``num_replicas`` (any ``autoscaling_config`` there is removed).
- ``max_batch_size`` and ``batch_wait_timeout_s`` go into the target's Serve ``user_config``, which the replica's
  ``reconfigure`` applies live (Serve updates running replicas in place: no restart, no rebuild of the app;
  the template's ``args`` are left alone, so only knobs that need one restart replicas).
  DLRM: ``{max_batch_size, batch_wait_timeout_s}`` (a ``BatchingConfig``: requests merged into one forward
  pass by ``@serve.batch``); the target's ``max_ongoing_requests`` becomes 2 x max_batch_size, room for one
  batch running and the next filling. Diffusion: ``{max_batch_rows}`` (UNet rows per denoising step; an image
  with classifier-free guidance takes two rows); the target's ``max_ongoing_requests`` becomes
  2 x max_batch_size and ``ImagesIngress``'s 2 x max_batch_size x num_replicas, so batches can fill. The
  diffusion engine batches continuously at step boundaries and has no wait timeout: that knob does not apply
  to it and is ignored.
- ``device_share`` on CPU:
  - ``ray_actor_options.num_cpus = share``: a scheduling reservation, not a cap. Ray places a replica only
    where that many CPUs are unreserved; the process itself may still run on every core of the node.
  - torch intra-op threads = ``torch_threads`` or ``max(1, round(share))``: the real CPU limit, the parallelism
    of the model's operators: ``args.model.torch_threads`` (``torch.set_num_threads`` in the replica; unset,
    Ray would set ``OMP_NUM_THREADS`` to ``floor(num_cpus)``, at least 1).
- ``device_share`` on GPU (``torch_threads`` is applied as above only when given):
  - ``ray_actor_options.num_gpus = share``: fractional GPUs are scheduling only; replicas sharing a GPU are
    isolated neither in memory nor in compute. Shares above 1 must be whole GPUs.
  - ``SWIFTSERVE_CUDA_MEMORY_FRACTION = min(share, 1)`` in the target's ``runtime_env.env_vars``, for the replica
    to pass to ``torch.cuda.set_per_process_memory_fraction``: a hard cap on PyTorch's caching allocator in that
    process (allocations beyond it raise out-of-memory); memory outside the allocator (CUDA context, other
    libraries) is not counted.
  - with ``mps=True``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = round(100 x min(share, 1))``: caps the share of SMs
    the process's kernels may occupy, enforced only when an MPS control daemon runs on the node (otherwise the
    variable has no effect).
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
    """A copy of ``app`` (a Serve application config as a dict) set to ``configuration``."""
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
