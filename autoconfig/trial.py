"""One profiling trial: deploy an application at a configuration, find its highest sustainable rate, tear it down.

Runs on the Ray cluster this process is connected to, beside the declarative applications already there (they
are re-applied unchanged). Status: ``ok``, ``slo_violated`` (not even the start rate met the SLO) or ``failed``
(error text recorded; also when the rate search ran out of probes or time before a deciding probe held). The
trial lifecycle: docs/AUTOCONFIG.md, "One trial".
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

from autoconfig.interference import Interference, measure_interference
from autoconfig.knobs import Accelerator, GpuShareMode, Knobs, configure_serve_config
from autoconfig.provenance import code_version, machine_id
from autoconfig.serve_config import load_serve_config, start_serve, wait_for_applications
from autoconfig.space import shortcut_values
from autoconfig.stress import ClientSettings, Probe, RateSearchResult, SearchSettings, StressClient
from autoconfig.workloads import RequestSource
from serving.common.net import free_port

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
    configuration: dict[str, Any]
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
    deployment_resources: dict[str, float] | None = None
    memory_mib: float | None = None
    duration_s: float
    error: str | None = None
    code: str | None = None  # the swiftserve commit that measured it (autoconfig.provenance)
    machine: str | None = None  # the hardware that measured it (autoconfig.provenance.machine_id)
    interference: Interference | None = None  # the node's CPU time the rate search lost to other work
    search: RateSearchResult | None = None


def _check_cluster_fits(app: ServeApplicationSchema, accelerator: Accelerator) -> None:
    """Fail fast, without deploying, when the app's deployments, as its config sets their resources and replica
    counts, need more of the device than the whole cluster has (Serve would wait forever to place them)."""
    resource, option = ("CPU", "num_cpus") if accelerator == "cpu" else ("GPU", "num_gpus")
    total = ray.cluster_resources().get(resource, 0.0)
    needs = {
        deployment["name"]: deployment.get("ray_actor_options", {}).get(option, 0.0)
        * (deployment["num_replicas"] if isinstance(deployment.get("num_replicas"), int) else 1)
        for deployment in app.model_dump(exclude_unset=True).get("deployments", [])
    }
    if sum(needs.values()) > total + 1e-9:
        parts = ", ".join(f"{name} {need:g}" for name, need in needs.items() if need)
        raise ValueError(f"the application needs {sum(needs.values()):g} {resource} ({parts}); "
                         f"the cluster has {total:g}")


def trial_application(
    template: ServeDeploySchema,
    app_name: str,
    configuration: Mapping[str, Any],
    *,
    accelerator: Accelerator,
    gpu_share_mode: GpuShareMode,
    name: str,
    route_prefix: str,
) -> ServeApplicationSchema:
    """Application ``app_name`` of ``template`` at ``configuration``, renamed to ``name`` at ``route_prefix``."""
    configured = configure_serve_config(template, app_name, configuration, accelerator=accelerator,
                                        gpu_share_mode=gpu_share_mode)
    app = next(app for app in configured.applications if app.name == app_name)
    raw = app.model_dump(exclude_unset=True) | {"name": name, "route_prefix": route_prefix}
    return ServeApplicationSchema.model_validate(raw)


def deployment_resources(app_details: Mapping[str, Any], accelerator: Accelerator) -> dict[str, float]:
    """CPUs (or GPUs) each deployment of a deployed app holds, from Serve's details of the app: per replica
    (``ray_actor_options``, Serve's default of one CPU when unset) times its target replicas."""
    option, default = ("num_cpus", 1.0) if accelerator == "cpu" else ("num_gpus", 0.0)
    held = {}
    for name, deployment in app_details.get("deployments", {}).items():
        options = deployment.get("deployment_config", {}).get("ray_actor_options") or {}
        per_replica = options.get(option)
        replicas = deployment.get("target_num_replicas", len(deployment.get("replicas", [])))
        held[name] = (default if per_replica is None else float(per_replica)) * replicas
    return held


def replica_memory_mib(app_details: Mapping[str, Any]) -> float | None:
    """Resident memory (RSS) of every running replica of an app, summed, in MiB: read from this node's processes;
    None when a replica runs on another node (or none runs)."""
    import psutil

    here = ray.util.get_node_ip_address()
    replicas = [replica for deployment in app_details.get("deployments", {}).values()
                for replica in deployment.get("replicas", []) if replica.get("state") == "RUNNING"]
    if not replicas or any(replica.get("node_ip") != here or not replica.get("pid") for replica in replicas):
        return None
    try:
        return sum(psutil.Process(replica["pid"]).memory_info().rss for replica in replicas) / 2**20
    except psutil.Error:  # a replica ended meanwhile
        return None


def _deploy(
    app: ServeApplicationSchema, template: ServeDeploySchema, http_port: int | None, timeout_s: float
) -> tuple[str, float, dict[str, Any], Any]:
    """Deploy ``app`` beside the running declarative apps; the base URL of its route prefix, the start time
    (``time.time()``) of its newest model replica, Serve's details of the deployed app, and Serve's client."""
    client = start_serve(template, http_port=http_port or free_port())
    instance = client.get_serve_details()
    kept = instance.get("applications", {}).get(app.name, {}).get("deployed_app_config")
    if kept and _restarts_replicas(kept, app.model_dump(mode="json", exclude_unset=True)):
        # Serve would roll the replicas over, starting new ones while the old still hold their CPUs or GPUs: on
        # a full node that waits forever. Deleting first frees them.
        serve.delete(app.name)
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
        newest = _wait_for_target_replicas(client, app, timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}: {_status_messages(app.name)}") from None
    host = client.http_config.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    details = client.get_serve_details()["applications"][app.name]
    return f"http://{host}:{client.http_config.port}{app.route_prefix.rstrip('/')}", newest, details, client


#: Options Serve changes on running replicas (or by adding and removing replicas), no restart. Serve fills the
#: app's ``logging_config`` in from the global one, so it is also left out of the comparison.
_LIVE_OPTIONS = frozenset({"num_replicas", "user_config", "max_ongoing_requests", "autoscaling_config",
                           "logging_config"})


def _restarts_replicas(deployed: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether updating application config ``deployed`` to ``new`` restarts replicas (anything beyond
    :data:`_LIVE_OPTIONS` differs: ``args``, resources, runtime environment...)."""

    def fixed(app: dict[str, Any]) -> dict[str, Any]:
        deployments = {d["name"]: {k: v for k, v in d.items() if k not in _LIVE_OPTIONS}
                       for d in app.get("deployments", [])}
        settings = {k: v for k, v in app.items() if k != "deployments" and k not in _LIVE_OPTIONS}
        return settings | {"deployments": deployments}

    return fixed(deployed) != fixed(new)


def _wait_for_target_replicas(client: Any, app: ServeApplicationSchema, timeout_s: float) -> float:
    """Block until every deployment the config gives a replica count runs exactly that many replicas, healthy, with
    its configured ``user_config`` (after an in-place update of a deployed trial app, RUNNING alone could still
    describe the old replicas); the start time of the newest replica of the app."""
    targets = [d for d in app.model_dump(exclude_unset=True).get("deployments", [])
               if isinstance(d.get("num_replicas"), int)]
    deadline = time.monotonic() + timeout_s
    while True:
        details = client.get_serve_details()["applications"].get(app.name, {}).get("deployments", {})
        behind = next((message for target in targets if (message := _behind(target, details.get(target["name"], {})))),
                      None)
        if behind is None:
            return max((replica.get("start_time_s", 0.0) for deployment in details.values()
                        for replica in deployment.get("replicas", []) if replica.get("state") == "RUNNING"),
                       default=0.0)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{behind} after {timeout_s:.0f}s")
        time.sleep(0.25)


def _behind(target: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """How deployment ``current`` (Serve's details) falls short of its configured entry ``target``; None if not."""
    running = [r for r in current.get("replicas", []) if r.get("state") == "RUNNING"]
    if len(running) != target["num_replicas"] or current.get("status") != "HEALTHY":
        return f"{target['name']} has {len(running)} of {target['num_replicas']} replicas running"
    if "user_config" in target and current.get("deployment_config", {}).get("user_config") != target["user_config"]:
        return f"{target['name']} has not taken its user_config"
    return None


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
    workload: RequestSource,
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
    configuration: Mapping[str, Any],
    workload: RequestSource,
    slo_p99_ms: float,
    *,
    warmup_s: float = 5.0,
    cold_warmup_s: float = 3.0,
    search: SearchSettings | None = None,
    client: ClientSettings | None = None,
    objective: Objective = "rate_per_share",
    accelerator: Accelerator = "cpu",
    gpu_share_mode: GpuShareMode = "memory",
    trial_app_name: str = TRIAL_APP_NAME,
    route_prefix: str = TRIAL_ROUTE_PREFIX,
    http_port: int | None = None,
    deploy_timeout_s: float = 300.0,
    teardown: bool = True,
    on_event: Callable[[TrialEvent], None] | None = None,
) -> TrialRecord:
    """Deploy application ``app_name`` of the template at ``configuration`` and measure it; never raises for a
    failing trial (only without a Ray connection, if the app cannot be deleted afterwards, or on interrupts).

    ``warmup_s`` of load at the start rate precede the rate search, ``cold_warmup_s`` more when the trial started
    model replicas (their first requests run cold). ``teardown=False`` keeps the app deployed after a trial that
    measured something, for the next trial of the same ``trial_app_name`` to update in place; the caller deletes
    it at the end (:func:`delete_trial_app`). A failed trial's app is always deleted.
    """
    if not ray.is_initialized():
        raise RuntimeError("not connected to a Ray cluster: call ray.init(address=...) before run_trial")

    emit = on_event or (lambda event: None)
    search = search or SearchSettings()
    started, started_wall = time.monotonic(), time.time()
    fields: dict[str, Any] = {"status": "failed", "sustainable_rps": 0.0}
    deploying = False
    try:
        shortcuts = shortcut_values(configuration)
        if shortcuts:
            knobs = Knobs.model_validate(shortcuts)
            fields |= {"device_share": knobs.device_share, "num_replicas": knobs.num_replicas,
                       "resources": knobs.resources}
        template = serve_config_template
        if not isinstance(template, ServeDeploySchema):
            template = load_serve_config(template)
        app = trial_application(
            template,
            app_name,
            configuration,
            accelerator=accelerator,
            gpu_share_mode=gpu_share_mode,
            name=trial_app_name,
            route_prefix=route_prefix,
        )
        _check_cluster_fits(app, accelerator)
        emit(TrialEvent(phase="deploy", message=f"deploying {app_name} as {trial_app_name} at {dict(configuration)}"))
        deploying = True
        base_url, newest_replica, details, serve_client = _deploy(app, template, http_port, deploy_timeout_s)
        held = deployment_resources(details, accelerator)  # every deployment's share: shards, ingress...
        fields |= {"resources": sum(held.values()), "deployment_resources": held}
        if newest_replica >= started_wall:  # this trial started replicas: their first requests run cold
            warmup_s += cold_warmup_s
        emit(TrialEvent(phase="warmup", message=f"warming up {warmup_s:g} s at {search.start_rps:g} rps"))
        with measure_interference() as interference:  # the search only: no replica starts or ends inside it
            result = asyncio.run(
                _search(base_url, workload, slo_p99_ms, warmup_s, client or ClientSettings(), search, emit)
            )
        fields |= search_fields(result, search.min_requests) | {"interference": interference.result}
        after_load = serve_client.get_serve_details()["applications"].get(trial_app_name, {})
        fields["memory_mib"] = replica_memory_mib(after_load)  # after the load: tables, caches, pools
    except Exception as exc:
        fields["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if deploying and (teardown or fields["status"] == "failed"):
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
        code=code_version(),
        machine=machine_id(),
        **fields,
    )


def search_fields(result: RateSearchResult, min_requests: int) -> dict[str, Any]:
    """A trial's fields from its rate search: ``ok`` with the best probe's measurements; ``slo_violated`` when no
    rate held, with the measurements of the deciding probe at the lowest rate (of a scout only when none decided);
    ``failed`` when the caps stopped the search before any deciding probe (``min_requests``) held."""
    fields: dict[str, Any] = {"search": result, "sustainable_rps": result.sustainable_rps}
    best = result.best
    if best is not None:
        return fields | {"status": "ok", "p50_ms": best.p50_ms, "p99_ms": best.p99_ms,
                         "error_rate": best.error_rate, "achieved_rps": best.achieved_rps}
    if result.stop_reason in ("max_probes", "max_time"):
        return fields | {"status": "failed", "error": f"the rate search reached its {result.stop_reason} cap "
                         f"before a deciding probe ({min_requests} requests) held: raise max_probes or max_total_s"}
    # how far from the SLO the lowest rate was: a deciding probe's verdict, not a one-second scout's few requests
    probes = [probe for probe in result.probes if probe.deciding] or result.probes
    lowest = min((probe.result for probe in probes), key=lambda load: load.rate, default=None)
    if lowest is not None:
        fields |= {"p50_ms": lowest.p50_ms, "p99_ms": lowest.p99_ms, "achieved_rps": lowest.achieved_rps,
                   "error_rate": lowest.error_rate}
    return fields | {"status": "slo_violated"}


def delete_trial_app(name: str = TRIAL_APP_NAME) -> None:
    """Delete a trial app kept deployed (``teardown=False``), if Serve runs and has it."""
    try:
        applications = serve.status().applications
    except Exception:  # Serve is not running on this cluster: nothing to delete
        return
    if name in applications:
        serve.delete(name)
