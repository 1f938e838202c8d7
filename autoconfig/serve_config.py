"""Serve config files: load, validate (including each application's ``args``), deploy, wait.

The same path as ``serve run CONFIG``: the config goes to the Serve controller, which imports and
builds every application. Validating ``args`` against each builder's pydantic model first turns a
typo in a YAML file into an error naming the field, before anything is deployed.
"""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from serving.common.http import field_path
from serving.common.logging import get_logger

if TYPE_CHECKING:
    from disagg.model_check import ModelReport

logger = get_logger("serve_config")


class ServeConfigError(ValueError):
    """A Serve config file that cannot be deployed; the message names the file and field."""


def load_serve_config(path: str | Path) -> ServeDeploySchema:
    """Parse and validate ``path`` against Ray's ``ServeDeploySchema`` and every builder's ``args`` model."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ServeConfigError(f"{path}: {exc}") from exc
    return parse_serve_config(text, source=str(path))


def parse_serve_config(config: str | Mapping[str, Any], *, source: str = "<serve config>") -> ServeDeploySchema:
    """Validate a Serve config given as YAML text (e.g. a RayService's ``serveConfigV2``) or as a parsed mapping,
    as ``load_serve_config`` does; error messages start with ``source``."""
    try:
        raw = yaml.safe_load(config) if isinstance(config, str) else config
    except yaml.YAMLError as exc:
        raise ServeConfigError(f"{source}: {exc}") from exc
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as exc:
        raise ServeConfigError(f"{source}: {_first_error(exc)}") from exc
    for index, app in enumerate(schema.applications):
        try:
            validate_app_args(app)
            validate_user_configs(app)
        except (ValidationError, ImportError, AttributeError, TypeError, ValueError) as exc:
            detail = _first_error(exc, prefix=("args",)) if isinstance(exc, ValidationError) else str(exc)
            raise ServeConfigError(f"{source}: applications[{index}] ({app.name}): {detail}") from exc
    return schema


#: The live settings (Serve ``user_config``) the built-in applications' model deployments read, by import path:
#: the deployment names (a pattern) and the model their ``reconfigure`` validates it against.
_USER_CONFIGS = {
    "disagg.app:build_app": ("*DLRM", "disagg.config:BatchingConfig"),
    "serving.app:build_app": ("DiffusionModel", "serving.config:EngineTuning"),
    "serving.app:build_multi_app": ("DiffusionModel*", "serving.config:EngineTuning"),  # _<name>, or Group
}


def validate_user_configs(app: ServeApplicationSchema) -> None:
    """Validate the ``user_config`` of a built-in application's model deployments as their ``reconfigure`` will;
    ValueError naming the deployment and key, a key no deployment reads (``batch_wait_timeout_s`` of the
    diffusion app) included."""
    known = _USER_CONFIGS.get(app.import_path)
    if known is None:
        return
    pattern, model_path = known
    model: type[BaseModel] = import_builder(model_path)
    for index, deployment in enumerate(app.deployments or []):
        if not fnmatch.fnmatchcase(deployment.name, pattern) or not isinstance(deployment.user_config, dict):
            continue
        try:
            model.model_validate(deployment.user_config)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = field_path(("deployments", index, "user_config", *error["loc"]))
            detail = "the deployment does not read it" if error["type"] == "extra_forbidden" else error["msg"]
            raise ValueError(f"{where}: {detail} ({deployment.name}'s user_config takes "
                             f"{', '.join(model.model_fields)})") from None


def validate_app_args(app: ServeApplicationSchema) -> BaseModel | dict[str, Any]:
    """Import ``app.import_path`` and validate ``app.args`` against its builder's annotated model.

    An app whose ``runtime_env`` brings its code (``working_dir``, ``py_modules``) and that this process cannot
    import is left to Serve, which imports and builds it inside that environment (as ``serve run`` does).
    """
    try:
        builder = import_builder(app.import_path)
    except ImportError:
        if brings_code(app):
            return app.args or {}
        raise
    if not inspect.isfunction(builder):
        if app.args:
            raise TypeError(f"{app.import_path} is a built application; it takes no args")
        return {}
    parameters = list(inspect.signature(builder).parameters.values())
    if len(parameters) != 1:
        raise TypeError(f"{app.import_path} must take exactly one parameter (the args)")
    annotation = parameters[0].annotation
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation.model_validate(app.args or {})
    return app.args or {}


def check_models(config: ServeDeploySchema, *, source: str = "<serve config>") -> dict[str, ModelReport]:
    """``check_model`` of every DLRM application (args validated as ``DLRMAppConfig``), its report by application
    name: builds each model's structure as ``build_app`` would, before anything is deployed. A model no replica
    could serve is a ServeConfigError naming ``source``, the application and the key."""
    from disagg.config import DLRMAppConfig
    from disagg.model_check import check_model
    from disagg.model_source import ModelError

    reports = {}
    for index, app in enumerate(config.applications):
        args = validate_app_args(app)
        if isinstance(args, DLRMAppConfig):
            try:
                reports[app.name] = check_model(args)
            except ModelError as exc:
                raise ServeConfigError(f"{source}: applications[{index}] ({app.name}): args.{exc}") from exc
    return reports


def brings_code(app: ServeApplicationSchema) -> bool:
    """Whether the app's ``runtime_env`` ships code to its replicas (``working_dir`` or ``py_modules``)."""
    runtime_env = app.runtime_env or {}
    return bool(runtime_env.get("working_dir") or runtime_env.get("py_modules"))


def import_builder(import_path: str) -> Any:
    """Resolve ``package.module:attribute`` (or ``package.module.attribute``)."""
    module_name, _, attribute = import_path.partition(":") if ":" in import_path else import_path.rpartition(".")
    if not module_name or not attribute:
        raise ImportError(f"import_path {import_path!r} must look like 'package.module:builder'")
    return getattr(importlib.import_module(module_name), attribute)


def _first_error(exc: ValidationError, prefix: tuple[str, ...] = ()) -> str:
    error = exc.errors()[0]
    return f"{field_path((*prefix, *error['loc']))}: {error['msg']}"


def start_serve(config: ServeDeploySchema, *, http_port: int | None = None) -> Any:
    """Serve started (or joined, if already running) with the config's HTTP and gRPC options, proxy location and
    logging; returns Serve's controller client. ``http_port`` (a trial's) replaces the HTTP port and leaves the gRPC
    proxy off: trials measure over HTTP, and the config's gRPC port may be taken by the app it tunes."""
    from ray.serve._private.api import serve_start

    http_options = config.http_options.model_dump() | ({"port": http_port} if http_port is not None else {})
    return serve_start(
        http_options=http_options,
        grpc_options=config.grpc_options.model_dump() if http_port is None else None,
        proxy_location=config.proxy_location,
        global_logging_config=config.logging_config,
    )


def deploy_serve_config(config: ServeDeploySchema, *, timeout_s: float = 300.0) -> None:
    """Start Serve with the config's HTTP options, deploy every application, wait until all run."""
    client = start_serve(config)
    client.deploy_apps(config)
    wait_for_applications([app.name for app in config.applications], timeout_s=timeout_s)


def wait_for_applications(names: list[str], *, timeout_s: float) -> None:
    """Block until every named application is RUNNING; raise with Serve's message if one fails."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while True:
        applications = serve.status().applications
        pending = []
        for name in names:
            status = applications.get(name)
            if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
                raise RuntimeError(f"application {name!r} failed to deploy: {status.message}")
            if status is None or status.status != ApplicationStatus.RUNNING:
                pending.append(name)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications {pending} not running after {timeout_s:.0f}s")
        time.sleep(0.5)
