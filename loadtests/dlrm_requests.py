"""What ``DLRMUser`` sends and checks, built from the load test's DLRM options: a pool of infer bodies from
autoconfig's workload of the served app, and the checks of its responses.

No locust here, so it imports anywhere; torch and Ray are imported on first use, after locust's gevent patching.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from disagg.signature import VARIABLE, OutputSignature

if TYPE_CHECKING:
    from ray.serve.schema import ServeApplicationSchema
    from settings import Settings

    from autoconfig.workloads import Workload

DLRM_IMPORT_PATH = "disagg.app:build_app"


class DLRMTarget(NamedTuple):
    """What a DLRM user sends and expects: ``path`` (route prefix included), the ``workload`` whose bodies it cycles
    through, the model's ``outputs``, and whether they are a preset's click ``probabilities`` (within [0, 1])."""

    path: str
    workload: Workload
    outputs: tuple[OutputSignature, ...]
    probabilities: bool


@lru_cache(maxsize=8)
def served_dlrm_app(serve_config: str, name: str) -> ServeApplicationSchema:
    """The DLRM application ``name`` of the Serve config file ``serve_config`` (validated as ``autoconfig check``
    does); ValueError naming the file and what is wrong."""
    from autoconfig.serve_config import load_serve_config

    config = load_serve_config(serve_config)
    app = next((app for app in config.applications if app.name == name), None)
    if app is None:
        raise ValueError(f"{serve_config}: no application {name!r}; applications: "
                         f"{', '.join(app.name for app in config.applications)}")
    if app.import_path != DLRM_IMPORT_PATH:
        raise ValueError(f"{serve_config}: application {name!r} runs {app.import_path}, not {DLRM_IMPORT_PATH}")
    return app


@lru_cache(maxsize=64)
def dlrm_target(serve_config: str | None, app_name: str, preset: str, model: str, prefix: str, rows: int, pool: int,
                variable_size: int, seed: int) -> DLRMTarget:
    """A pool of ``pool`` OIP v2 JSON bodies of ``rows`` rows (one pool per seed, built once) for the app ``app_name``
    of ``serve_config`` (its model, route prefix and model name), else for ``preset`` served as ``model`` under
    ``prefix``: ``autoconfig.workloads.workload_for_app``'s, as autoconfig sends, with ``variable_size`` along the
    inputs' variable dimensions. ValueError (a ``ModelError`` naming the key) when they cannot be built."""
    from autoconfig.workloads import workload_for_app
    from disagg.config import DLRMAppConfig

    import_path, args = DLRM_IMPORT_PATH, {"model": {"preset": preset}, "model_name": model}
    if serve_config is not None:
        app = served_dlrm_app(serve_config, app_name)
        import_path, args, prefix = app.import_path, app.args or {}, app.route_prefix or "/"
    options = {"rows_per_request": rows, "pool_size": pool, "variable_size": variable_size, "seed": seed}
    workload = workload_for_app(import_path, args, options)
    served = DLRMAppConfig.model_validate(args).model
    return DLRMTarget(prefix.rstrip("/") + workload.path, workload, tuple(served.signature().outputs),
                      served.factory is None)


def settings_target(settings: Settings, seed: int) -> DLRMTarget:
    """``dlrm_target`` of ``settings``' DLRM options with ``seed``."""
    return dlrm_target(settings.dlrm_serve_config, settings.dlrm_app, settings.dlrm_preset, settings.dlrm_model,
                       settings.dlrm_prefix, settings.dlrm_rows, settings.dlrm_pool, settings.dlrm_variable_size, seed)


def output_problem(output: Mapping[str, Any], expected: OutputSignature, rows: int, probabilities: bool) -> str | None:
    """Why the response tensor ``output`` is not ``expected`` for ``rows`` rows (its rank, fixed sizes, finite
    values; with ``probabilities``, each within [0, 1]), or None."""
    shape, values = output["shape"], [float(value) for value in output["data"]]
    wanted = [rows, *expected.shape[1:]]
    fits = len(shape) == len(wanted) and all(want in (VARIABLE, got) for want, got in zip(wanted, shape, strict=True))
    if not fits or len(values) != math.prod(shape):
        return f"expected {expected.name} of shape {wanted}, got shape {shape} with {len(values)} values"
    if not all(math.isfinite(value) for value in values):
        return f"{expected.name}: values not finite"
    if probabilities and not all(0.0 <= value <= 1.0 for value in values):
        return f"{expected.name} outside [0, 1]"
    return None
