"""Knob values written into a Ray Serve config: what a configuration means for a deployment.

``apply_knobs`` sets the shortcuts ``max_batch_size``, ``batch_wait_timeout_s``, ``device_share``, ``num_replicas``
and optionally ``torch_threads`` on the deployment holding a built-in application's model (``APP_KNOBS``: a shortcut
the application does not read is refused), then each dotted-path knob (``Deployment.option[.key]``, the name may be
a pattern, or ``args.key``) on the deployment entries or the args it names. On a GPU the ``GpuShareMode`` says what
a ``device_share`` below 1 divides; what each knob sets and what that enforces is in docs/AUTOCONFIG.md.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, RayActorOptionsSchema, ServeDeploySchema

from autoconfig.gpu_share import GpuShareMode, gpu_overcommit, gpu_share_env
from autoconfig.serve_config import validate_app_args, validate_user_configs
from autoconfig.space import SearchSpace, SpaceError, describe_validation_error, is_path_knob, shortcut_values

Accelerator = Literal["cpu", "gpu"]
CPU_SHARE_ENV = "SWIFTSERVE_CPU_SHARE"


class Knobs(BaseModel):
    """A validated configuration; an unknown knob is an error naming it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(ge=1)
    batch_wait_timeout_s: float | None = Field(None, ge=0.0, le=10.0)
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
    ``max_ongoing_requests`` (the target's name is passed in); ``threads`` is a key path under ``args`` (an int
    indexes a list); ``reads``: the shortcuts the application acts on (any other is refused).
    """

    target: Callable[[Mapping[str, Any]], str]
    user_config: Callable[[Knobs], dict[str, Any]]
    max_ongoing: Callable[[Knobs, str], dict[str, int]]
    threads: tuple[str | int, ...]
    reads: frozenset[str]


def default_model_name(args: Mapping[str, Any]) -> str:
    """The first model of a ``serving.app:build_multi_app`` app (``args.models[0]``): the one requests that name
    no ``model`` reach, and the one its shortcuts tune."""
    from serving.config import DiffusionModelConfig  # a leaf module (pydantic only): no diffusion code

    models = args.get("models") or [{}]
    return (models[0].get("model") or {}).get("name") or DiffusionModelConfig.model_fields["name"].default


_SHORTCUTS = frozenset(Knobs.model_fields)


def _images_knobs(target: Callable[[Mapping[str, Any]], str], threads: tuple[str | int, ...]) -> AppKnobs:
    return AppKnobs(
        target=target,
        user_config=lambda knobs: {"max_batch_rows": knobs.max_batch_size},
        max_ongoing=lambda knobs, target: {
            target: 2 * knobs.max_batch_size,
            "ImagesIngress": 2 * knobs.max_batch_size * knobs.num_replicas,
        },
        threads=threads,
        reads=_SHORTCUTS - {"batch_wait_timeout_s"},  # the engine batches at step boundaries: no batching timer
    )


APP_KNOBS: Mapping[str, AppKnobs] = {
    "disagg.app:build_app": AppKnobs(
        target=lambda args: "MonolithicDLRM" if args.get("serving") == "monolithic" else "DisaggregatedDLRM",
        user_config=lambda knobs: knobs.model_dump(include={"max_batch_size", "batch_wait_timeout_s"},
                                                   exclude_none=True),
        max_ongoing=lambda knobs, target: {target: 2 * knobs.max_batch_size},
        threads=("model", "torch_threads"),
        reads=_SHORTCUTS,
    ),
    "serving.app:build_app": _images_knobs(lambda args: "DiffusionModel", ("model", "torch_threads")),
    # Several models: the shortcuts tune the first (the default) model's deployment; the others keep the template's.
    # With shared_replicas, the one deployment of every model.
    "serving.app:build_multi_app": _images_knobs(
        lambda args: ("DiffusionModelGroup" if args.get("shared_replicas")
                      else f"DiffusionModel_{default_model_name(args)}"),
        ("models", 0, "model", "torch_threads")),
}


def _unread_shortcut(knobs: Iterable[str], import_path: str) -> str | None:
    """The first of ``knobs`` that is a shortcut the application at ``import_path`` does not read, with why, or
    None."""
    mapping = APP_KNOBS.get(import_path)
    if mapping is None:
        return None
    for name in knobs:
        if not is_path_knob(name) and name not in mapping.reads:
            return (f"{name}: no deployment of {import_path} reads it (its shortcuts: "
                    f"{', '.join(sorted(mapping.reads))}); drop it from the space")
    return None


def _set(tree: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Set ``value`` at ``path`` in ``tree``, creating missing mappings; in a list a key is an index (the dotted
    path ``args.models.0.engine.max_batch_rows``)."""
    for depth, key in enumerate(path):
        if isinstance(tree, list):
            index = int(key) if str(key).isdigit() else None
            if index is None or index >= len(tree):
                where = ".".join(map(str, path[:depth + 1]))
                raise ValueError(f"{where}: a list of {len(tree)} item(s), no item {key!r}")
            key = index
        if depth == len(path) - 1:
            tree[key] = value
        else:
            tree = tree[key] if isinstance(tree, list) else tree.setdefault(key, {})


def _deployment(app: dict[str, Any], name: str) -> dict[str, Any]:
    deployments = app.setdefault("deployments", [])
    found = next((deployment for deployment in deployments if deployment["name"] == name), None)
    if found is None:
        found = {"name": name}
        deployments.append(found)
    return found


#: Options of a deployment entry whose keys a dotted path may name (None: any key, e.g. ``user_config``).
_NESTED_OPTIONS: Mapping[str, frozenset[str] | None] = {
    "user_config": None,
    "ray_actor_options": frozenset(RayActorOptionsSchema.model_fields),
    "autoscaling_config": frozenset(AutoscalingConfig.model_fields),
}
_FREE_ACTOR_OPTIONS = frozenset({"resources", "runtime_env"})  # their keys are free


def _path_error(option: tuple[str, ...]) -> str | None:
    """Why a deployment entry has no option at ``option`` (the path after the deployment name), or None."""
    top = option[0]
    options = sorted(set(DeploymentSchema.model_fields) - {"name"})
    if top not in options:
        return f"{top!r} is not a deployment option; options: {', '.join(options)}"
    if len(option) == 1:
        return None
    if top not in _NESTED_OPTIONS:
        return f"{top!r} takes a value, not keys"
    keys = _NESTED_OPTIONS[top]
    if keys is not None and option[1] not in keys:
        return f"{option[1]!r} is not an option of {top}; options: {', '.join(sorted(keys))}"
    if top == "ray_actor_options" and len(option) > 2 and option[1] not in _FREE_ACTOR_OPTIONS:
        return f"ray_actor_options.{option[1]} takes a value, not keys"
    return None


def _apply_path(app: dict[str, Any], knob: str, value: Any, accelerator: Accelerator,
                gpu_share_mode: GpuShareMode) -> None:
    """Set dotted-path knob ``Deployment.option[.key]`` on every deployment entry ``Deployment`` names (a
    shell-style pattern may name several: ``EmbeddingShard_*``), or ``args.key[.key]`` in the app's args. A CPU or
    GPU count set this way is a share as ``device_share`` is: enforced on CPU, divided by the mode on GPU."""
    head, *option = knob.split(".")
    if not option:
        raise ValueError(f"knob {knob}: not a knob; use the shortcuts or a dotted path Deployment.option[.key]")
    if head == "args":  # the builder's model (built-in apps) or Serve checks the key
        try:
            _set(app.setdefault("args", {}), tuple(option), value)
        except ValueError as exc:
            raise ValueError(f"knob {knob}: args.{exc}") from None
        return
    entries = app.get("deployments") or []
    matches = [entry for entry in entries if fnmatch.fnmatchcase(str(entry.get("name", "")), head)]
    if not matches:
        listed = ", ".join(entry.get("name", "?") for entry in entries) or "none"
        raise ValueError(f"knob {knob}: application {app.get('name')!r} lists no deployment {head!r} (listed: "
                         f"{listed}); add `- name: {head}` to its deployments to tune it")
    error = _path_error(tuple(option))
    if error is not None:
        raise ValueError(f"knob {knob}: {error}")
    for deployment in matches:
        _set(deployment, tuple(option), value)
        if option == ["num_replicas"]:
            deployment.pop("autoscaling_config", None)  # a fixed replica count is tuned
        env: dict[str, str] = {}
        if option == ["ray_actor_options", "num_cpus"] and accelerator == "cpu":  # our replicas enforce it
            env = {CPU_SHARE_ENV: str(value)}
        elif option == ["ray_actor_options", "num_gpus"] and accelerator == "gpu" and value:
            env = gpu_share_env(float(value), gpu_share_mode)
        for name, setting in env.items():
            _set(deployment, ("ray_actor_options", "runtime_env", "env_vars", name), setting)


def apply_knobs(
    app: Mapping[str, Any],
    configuration: Mapping[str, Any],
    *,
    accelerator: Accelerator = "cpu",
    gpu_share_mode: GpuShareMode = "memory",
) -> dict[str, Any]:
    """A copy of ``app`` (a Serve application config as a dict) set to ``configuration``: the shortcuts first,
    then the dotted paths.

    Raises ``ValueError`` for shortcuts on an ``import_path`` without them or that it does not read, a dotted path
    naming no listed deployment or no option, or a GPU share above 1 that is not whole.
    """
    app = copy.deepcopy(dict(app))
    shortcuts = shortcut_values(configuration)
    if shortcuts:
        _apply_shortcuts(app, shortcuts, accelerator, gpu_share_mode)
    for knob, value in configuration.items():
        if is_path_knob(knob):
            _apply_path(app, knob, value, accelerator, gpu_share_mode)

    return app


def _apply_shortcuts(app: dict[str, Any], configuration: Mapping[str, Any], accelerator: Accelerator,
                     gpu_share_mode: GpuShareMode) -> None:
    knobs = Knobs.model_validate(dict(configuration))
    import_path = app.get("import_path", "")
    mapping = APP_KNOBS.get(import_path)
    if mapping is None:
        raise ValueError(f"import_path {import_path!r} has no shortcut knobs (known: "
                         f"{', '.join(APP_KNOBS)}); name its options as dotted paths, e.g. Model.num_replicas")
    unread = _unread_shortcut(configuration, import_path)
    if unread is not None:
        raise ValueError(f"knob {unread}")
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
        env.update(gpu_share_env(knobs.device_share, gpu_share_mode))
    if threads is not None:
        _set(args, mapping.threads, threads)
    if env:
        actor.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(env)


def configure_serve_config(
    config: ServeDeploySchema,
    app_name: str,
    configuration: Mapping[str, Any],
    *,
    accelerator: Accelerator = "cpu",
    gpu_share_mode: GpuShareMode = "memory",
) -> ServeDeploySchema:
    """``config`` with application ``app_name`` set to ``configuration``, validated as ``load_serve_config`` does."""
    raw = config.model_dump(exclude_unset=True)
    names = [app["name"] for app in raw["applications"]]
    if app_name not in names:
        raise ValueError(f"no application {app_name!r} in the Serve config; it has: {', '.join(names)}")
    index = names.index(app_name)
    raw["applications"][index] = apply_knobs(
        raw["applications"][index], configuration, accelerator=accelerator, gpu_share_mode=gpu_share_mode
    )
    configured = ServeDeploySchema.model_validate(raw)
    validate_app_args(configured.applications[index])
    validate_user_configs(configured.applications[index])
    return configured


def check_space(
    config: ServeDeploySchema,
    app_name: str,
    space: SearchSpace,
    *,
    accelerator: Accelerator = "cpu",
    gpu_share_mode: GpuShareMode = "memory",
) -> None:
    """Refuse, before any trial, a space that application ``app_name`` cannot take: a :class:`SpaceError` names
    the knob (shortcuts on an app without them or that it does not read, a dotted path naming no listed deployment
    or no option, a ``user_config`` key its deployment does not read) or the knob and value Serve's schema refuses
    or whose GPU shares overflow a GPU (each value tried on the space's first configuration)."""
    app = next((app for app in config.applications if app.name == app_name), None)
    unread = None if app is None else _unread_shortcut(space.knob_names, app.import_path)
    if unread is not None:
        raise SpaceError(f"knobs.{unread}")
    base = space.configurations()[0].as_dict()
    for name in space.knob_names:
        for i, value in enumerate(space.values(name)):
            try:
                configured = configure_serve_config(config, app_name, base | {name: value}, accelerator=accelerator,
                                                    gpu_share_mode=gpu_share_mode)
            except ValidationError as exc:
                raise SpaceError(f"knobs.{name}.values[{i}] = {value!r}: Serve refuses it: "
                                 f"{describe_validation_error(exc)}") from None
            except (ValueError, TypeError, ImportError) as exc:
                raise SpaceError(f"knobs.{name}: {str(exc).removeprefix(f'knob {name}: ')}") from None
            overflow = gpu_overcommit(configured) if accelerator == "gpu" else None
            if overflow is not None:
                raise SpaceError(f"knobs.{name}.values[{i}] = {value!r}: {overflow}")


def write_serve_config(config: ServeDeploySchema, path: str | Path) -> None:
    """Write ``config`` as a YAML file for ``serve deploy`` / ``autoconfig check`` (only the fields set)."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_unset=True), sort_keys=False))
