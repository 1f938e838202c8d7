"""Real autoconfig trials on the session's Ray cluster: the tiny DLRM deployed beside the session's apps, measured
over HTTP and deleted again; failing trials are recorded, not raised, and leave nothing behind."""


import httpx
import pytest
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from autoconfig.interference import system_processes
from autoconfig.provenance import code_version, cpu_model, machine_id
from autoconfig.serve_config import load_serve_config
from autoconfig.stress import ClientSettings, SearchSettings
from autoconfig.trial import TrialEvent, delete_trial_app, run_trial
from autoconfig.workloads import dlrm_workload
from tests.helpers.replicas import kill_replica, named_replicas
from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration

TRIAL_APP, TRIAL_PREFIX = "autoconfig-trial", "/trial/v2"
SLO_MS = 500.0
CONFIGURATION = {"max_batch_size": 8, "batch_wait_timeout_s": 0.002, "device_share": 0.25, "num_replicas": 1}
SESSION_APPS = {"diffusion", "diffusion-cfg", "dlrm", "dlrm-mono"}


@pytest.fixture(scope="module")
def template(base_url: str) -> ServeDeploySchema:
    """deploy/serve_config.yaml with the DLRM served monolithically (one light deployment). Depends on
    ``base_url`` so Serve already runs on the session's port and the trial must leave its apps alone."""
    raw = load_serve_config(REPO / "deploy" / "serve_config.yaml").model_dump(exclude_unset=True)
    dlrm = next(app for app in raw["applications"] if app["name"] == "dlrm")
    dlrm["args"]["serving"] = "monolithic"
    dlrm["deployments"] = []  # the knobs add MonolithicDLRM
    return ServeDeploySchema.model_validate(raw)


def _trial(template: ServeDeploySchema, configuration: dict, events: list | None = None, on_event=None, **kwargs):
    return run_trial(
        template, "dlrm", configuration, dlrm_workload(), SLO_MS, warmup_s=1.0,
        search=SearchSettings(start_rps=5, probe_s=1.0, min_requests=10, max_probes=8, rel_tolerance=0.5),
        client=ClientSettings(timeout_s=5.0, max_in_flight=32),
        trial_app_name=TRIAL_APP, route_prefix=TRIAL_PREFIX,
        on_event=on_event or (events.append if events is not None else None), **kwargs,
    )  # fmt: skip


def _replica_details() -> list[dict]:
    applications = _get_global_client().get_serve_details()["applications"]
    return [replica for name in SESSION_APPS for deployment in applications[name]["deployments"].values()
            for replica in deployment["replicas"]]


def _session_replicas() -> set[str]:
    return {replica["replica_id"] for replica in _replica_details()}


def _assert_trial_app_gone(base_url: str) -> None:
    applications = serve.status().applications
    assert TRIAL_APP not in applications
    assert applications.keys() >= SESSION_APPS  # re-applied unchanged, not deleted
    assert httpx.get(f"{base_url}{TRIAL_PREFIX}/health/live", timeout=30).status_code == 404


def test_trial_of_the_tiny_dlrm_finds_a_rate_within_the_slo_and_removes_the_app(template, base_url):
    events, replicas = [], _session_replicas()
    record = _trial(template, CONFIGURATION, events)
    print(f"trial: {record.sustainable_rps:g} rps, p99 {record.p99_ms:.1f} ms, {record.duration_s:.1f} s")
    assert record.status == "ok", record.error
    assert record.sustainable_rps >= 5 and record.p99_ms <= SLO_MS and record.error_rate <= 0.01
    assert record.achieved_rps > 0
    assert record.code == code_version()  # which swiftserve measured it
    assert record.machine == machine_id() and cpu_model() in record.machine  # on which hardware
    print(f"interference: {record.interference}")
    assert record.interference is not None  # what the rate search lost to other work
    replica_pids = {replica["pid"] for replica in _replica_details()}
    assert replica_pids and replica_pids <= {process.pid for process in system_processes()}  # not foreign
    assert record.resources == 0.25 and record.objective == pytest.approx(record.sustainable_rps / 0.25)
    assert record.deployment_resources == {"MonolithicDLRM": 0.25}  # the app's only deployment, as deployed
    assert [probe.result.rate for probe in record.search.probes][:2] == [5, 10]
    phases = [event.phase for event in events]
    assert phases[:2] == ["deploy", "warmup"] and phases[-1] == "teardown"
    assert phases.count("probe") == len(record.search.probes) + 1  # an opening line, then one per probe
    _assert_trial_app_gone(base_url)
    assert _session_replicas() == replicas  # the session's apps were re-applied as they were: no restarts


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"device_share": 64}, "the cluster has"),  # 64 CPUs: refused before deploying
        ({"max_batch_size": 0}, "max_batch_size"),  # refused before anything is deployed
    ],
)
def test_failing_trials_are_recorded_and_leave_nothing_behind(template, base_url, change, error):
    record = _trial(template, CONFIGURATION | change, deploy_timeout_s=10.0)
    assert record.status == "failed" and error in record.error
    assert record.objective == 0 and record.sustainable_rps == 0 and record.search is None
    assert record.duration_s < 90
    _assert_trial_app_gone(base_url)


def test_an_unplaceable_replica_times_out_as_a_failed_trial(template, base_url):
    raw = template.model_dump(exclude_unset=True)
    dlrm = next(app for app in raw["applications"] if app["name"] == "dlrm")
    dlrm["deployments"] = [{"name": "MonolithicDLRM", "ray_actor_options": {"resources": {"no_such_node": 1}}}]
    record = _trial(ServeDeploySchema.model_validate(raw), CONFIGURATION, deploy_timeout_s=10.0)
    assert record.status == "failed" and "not running after 10s" in record.error
    assert record.duration_s < 90
    _assert_trial_app_gone(base_url)


def test_a_crashing_replica_is_a_failed_trial(template, base_url):
    raw = template.model_dump(exclude_unset=True)
    next(app for app in raw["applications"] if app["name"] == "dlrm")["args"]["model"]["device"] = "cuda:7"
    record = _trial(ServeDeploySchema.model_validate(raw), CONFIGURATION, deploy_timeout_s=120.0)
    assert record.status == "failed" and "failed to deploy" in record.error
    _assert_trial_app_gone(base_url)


def _model_deployment() -> dict:
    return _get_global_client().get_serve_details()["applications"][TRIAL_APP]["deployments"]["MonolithicDLRM"]


def _model_replicas() -> set[str]:
    return {replica["actor_id"] for replica in _model_deployment()["replicas"] if replica["state"] == "RUNNING"}


def test_a_kept_trial_app_is_updated_in_place_and_restarted_only_for_resources(template, base_url):
    try:
        first = _trial(template, CONFIGURATION, teardown=False)
        assert first.status != "failed", first.error
        replicas = _model_replicas()
        assert len(replicas) == 1
        second = _trial(template, CONFIGURATION | {"max_batch_size": 16}, teardown=False)
        assert second.status != "failed", second.error
        assert _model_deployment()["deployment_config"]["user_config"]["max_batch_size"] == 16
        assert _model_replicas() == replicas  # batching is reconfigured live, in the same replica
        third = _trial(template, CONFIGURATION | {"device_share": 0.3}, teardown=False)
        assert third.status != "failed", third.error
        assert len(_model_replicas()) == 1 and _model_replicas().isdisjoint(replicas)  # new CPUs: new replica
    finally:
        delete_trial_app(TRIAL_APP)
    _assert_trial_app_gone(base_url)


def test_a_trial_whose_replica_is_killed_mid_measurement_still_returns_a_record_and_the_next_trial_works(
        template, base_url):
    """The replica under measurement dies as the rate search starts: the trial still returns a record (the dead
    replica's failures count against the rate, nothing hangs); Serve's replacement serves the next trial."""
    killed: list[str] = []

    def kill_on_search_start(event: TrialEvent) -> None:
        if event.phase == "probe" and event.probe is None and not killed:
            (replica,) = named_replicas(TRIAL_APP, "MonolithicDLRM")
            kill_replica(replica)
            killed.append(replica["name"])

    record = _trial(template, CONFIGURATION, on_event=kill_on_search_start)
    assert killed, "the search never started"
    assert record.status in ("ok", "slo_violated"), record.error
    assert record.search is not None and record.search.probes
    _assert_trial_app_gone(base_url)

    again = _trial(template, CONFIGURATION)
    assert again.status == "ok", again
    _assert_trial_app_gone(base_url)
