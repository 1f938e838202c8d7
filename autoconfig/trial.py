"""One profiling trial: deploy an application at a configuration, find its highest sustainable rate, tear it down.

The trial runs on the Ray cluster this process is already connected to (``ray.init``). The application under
test is deployed declaratively under its own name and route prefix next to whatever declarative applications
already run there: Serve's ``apply_config`` deletes declarative apps missing from the config it is given, so the
running ones are re-applied unchanged (a no-op for them). If Serve is not running it is started on the template's
host and ``http_port`` (default: a free port) and left running for the next trial.

Status: ``ok`` (a sustainable rate was found), ``slo_violated`` (not even the start rate met the SLO) or ``failed``
(an invalid configuration, a deploy error or timeout, a crash: the error text is recorded and the caller's search
goes on). The application is deleted (``serve.delete``, which waits until it is gone) in every case.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import ray
from pydantic import BaseModel
from ray import serve
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from autoconfig.knobs import Accelerator, Knobs, configure_serve_config
from autoconfig.stress import ClientSettings, Probe, RateSearchResult, SearchSettings, StressClient
from autoconfig.workloads import Workload
from serving.common.net import free_port
from serving.common.serve_config import load_serve_config, start_serve, wait_for_applications

Objective = Literal["rate_per_share", "max_rate"]
TrialStatus = Literal["ok", "slo_violated", "failed"]
TRIAL_APP_NAME = "autoconfig-trial"
TRIAL_ROUTE_PREFIX = "/autoconfig-trial"


class TrialEvent(BaseModel):
    """Progress of a trial, for the caller to render."""

    phase: Literal["deploy", "warmup", "probe", "teardown"]
    message: str
    probe: Probe | None = None


class TrialRecord(BaseModel):
    """What one trial measured. ``objective`` is 0 unless ``status`` is ``ok``; latencies are at the best rate."""

    app_name: str
    configuration: dict[str, float | int]
    status: TrialStatus
    objective_name: Objective
    objective: float
    sustainable_rps: float
    p50_ms: float | None = None
    p99_ms: float | None = None
    error_rate: float | None = None
    achieved_rps: float | None = None
    device_share: float | None = None
    num_replicas: int | None = None
    resources: float | None = None
    duration_s: float
    error: str | None = None
    search: RateSearchResult | None = None


def _check_cluster_fits(knobs: Knobs, accelerator: Accelerator) -> None:
    """Fail fast, without deploying, when the replicas' device share exceeds what the whole cluster has."""
    resource = "CPU" if accelerator == "cpu" else "GPU"
    total = ray.cluster_resources().get(resource, 0.0)
    if knobs.resources > total + 1e-9:
        raise ValueError(f"{knobs.num_replicas} replica(s) x {knobs.device_share:g} {resource} need "
                         f"{knobs.resources:g} {resource}; the cluster has {total:g}")


def trial_application(
    template: ServeDeploySchema,
    app_name: str,
    configuration: Mapping[str, float | int],
    *,
    accelerator: Accelerator,
    mps: bool,
    name: str,
    route_prefix: str,
) -> ServeApplicationSchema:
    """Application ``app_name`` of ``template`` at ``configuration``, renamed to ``name`` at ``route_prefix``."""
    configured = configure_serve_config(template, app_name, configuration, accelerator=accelerator, mps=mps)
    app = next(app for app in configured.applications if app.name == app_name)
    raw = app.model_dump(exclude_unset=True) | {"name": name, "route_prefix": route_prefix}
    return ServeApplicationSchema.model_validate(raw)


def _deploy(app: ServeApplicationSchema, template: ServeDeploySchema, http_port: int | None, timeout_s: float) -> str:
    """Deploy ``app`` beside the running declarative apps; the base URL of its route prefix."""
    client = start_serve(template, http_port=http_port or free_port())
    instance = client.get_serve_details()
    running = [
        ServeApplicationSchema.model_validate(details["deployed_app_config"])
        for name, details in instance.get("applications", {}).items()
        if name != app.name and details.get("deployed_app_config") and details.get("status") != "DELETING"
    ]
    client.deploy_apps(
        ServeDeploySchema(
            applications=[*running, app],
            logging_config=template.logging_config,
            target_capacity=instance.get("target_capacity"),
        )
    )
    try:
        wait_for_applications([app.name], timeout_s=timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}: {_status_messages(app.name)}") from None
    host = client.http_config.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{client.http_config.port}{app.route_prefix.rstrip('/')}"


def _status_messages(app_name: str) -> str:
    """Serve's messages about an application and its deployments (why it is not running)."""
    status = serve.status().applications.get(app_name)
    if status is None:
        return "no status"
    parts = [f"{status.status}: {status.message}"] if status.message else [str(status.status)]
    parts += [f"{name}: {d.message}" for name, d in status.deployments.items() if d.message]
    return "; ".join(parts)


async def _search(
    base_url: str,
    workload: Workload,
    slo_p99_ms: float,
    warmup_s: float,
    client: ClientSettings,
    search: SearchSettings,
    emit: Callable[[TrialEvent], None],
) -> RateSearchResult:
    async with StressClient(base_url, workload, client) as stress:
        if warmup_s > 0:
            await stress.measure(search.start_rps, warmup_s)

        def on_probe(probe: Probe) -> None:
            result = probe.result
            p99 = "-" if result.p99_ms is None else f"{result.p99_ms:.1f} ms"
            verdict = "ok" if probe.sustainable else "breaks SLO"
            emit(
                TrialEvent(
                    phase="probe",
                    message=f"{result.rate:.1f} rps: p99 {p99}, errors {result.error_rate:.1%} -> {verdict}",
                    probe=probe,
                )
            )

        emit(TrialEvent(phase="probe", message=f"searching the highest rate with p99 <= {slo_p99_ms:g} ms"))
        return await stress.find_sustainable_rate(slo_p99_ms, search, on_probe=on_probe)


def run_trial(
    serve_config_template: ServeDeploySchema | str | Path,
    app_name: str,
    configuration: Mapping[str, float | int],
    workload: Workload,
    slo_p99_ms: float,
    *,
    warmup_s: float = 5.0,
    search: SearchSettings | None = None,
    client: ClientSettings | None = None,
    objective: Objective = "rate_per_share",
    accelerator: Accelerator = "cpu",
    mps: bool = False,
    trial_app_name: str = TRIAL_APP_NAME,
    route_prefix: str = TRIAL_ROUTE_PREFIX,
    http_port: int | None = None,
    deploy_timeout_s: float = 300.0,
    on_event: Callable[[TrialEvent], None] | None = None,
) -> TrialRecord:
    """Deploy application ``app_name`` of the template at ``configuration`` and measure it; never raises for a
    failing trial (only without a Ray connection, if the app cannot be deleted afterwards, or on interrupts)."""
    if not ray.is_initialized():
        raise RuntimeError("not connected to a Ray cluster: call ray.init(address=...) before run_trial")

    emit = on_event or (lambda event: None)
    search = search or SearchSettings()
    started = time.monotonic()
    fields: dict[str, Any] = {"status": "failed", "sustainable_rps": 0.0}
    deploying = False
    try:
        knobs = Knobs.model_validate(dict(configuration))
        fields |= {"device_share": knobs.device_share, "num_replicas": knobs.num_replicas, "resources": knobs.resources}
        _check_cluster_fits(knobs, accelerator)
        template = serve_config_template
        if not isinstance(template, ServeDeploySchema):
            template = load_serve_config(template)
        app = trial_application(
            template,
            app_name,
            configuration,
            accelerator=accelerator,
            mps=mps,
            name=trial_app_name,
            route_prefix=route_prefix,
        )
        emit(TrialEvent(phase="deploy", message=f"deploying {app_name} as {trial_app_name} at {dict(configuration)}"))
        deploying = True
        base_url = _deploy(app, template, http_port, deploy_timeout_s)
        emit(TrialEvent(phase="warmup", message=f"warming up {warmup_s:g} s at {search.start_rps:g} rps"))
        result = asyncio.run(
            _search(base_url, workload, slo_p99_ms, warmup_s, client or ClientSettings(), search, emit)
        )
        fields |= {
            "search": result,
            "sustainable_rps": result.sustainable_rps,
            "status": "ok" if result.best else "slo_violated",
        }
        if result.best is not None:
            best = result.best
            fields |= {
                "p50_ms": best.p50_ms,
                "p99_ms": best.p99_ms,
                "error_rate": best.error_rate,
                "achieved_rps": best.achieved_rps,
            }
    except Exception as exc:
        fields["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if deploying:
            emit(TrialEvent(phase="teardown", message=f"deleting {trial_app_name}"))
            serve.delete(trial_app_name)
    rate, resources = fields["sustainable_rps"], fields.get("resources")
    value = rate / resources if objective == "rate_per_share" and resources else rate
    return TrialRecord(
        app_name=app_name,
        configuration=dict(configuration),
        objective_name=objective,
        objective=value if fields["status"] == "ok" else 0.0,
        duration_s=time.monotonic() - started,
        **fields,
    )
