"""Knob values written into deploy/serve_config.yaml: both applications, CPU and GPU, validated like a real deploy."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from autoconfig.cli import main as autoconfig_main
from autoconfig.knobs import apply_knobs, configure_serve_config, write_serve_config
from disagg.config import DLRMAppConfig
from serving.common.serve_config import load_serve_config, validate_app_args
from serving.config import DiffusionAppConfig

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"
CONFIGURATION = {"max_batch_size": 32, "batch_wait_timeout_s": 0.02, "device_share": 1.6, "num_replicas": 3}


@pytest.fixture(scope="module")
def template() -> ServeDeploySchema:
    return load_serve_config(SERVE_CONFIG)


def _app(config: ServeDeploySchema, name: str) -> dict:
    return next(app for app in config.model_dump(exclude_unset=True)["applications"] if app["name"] == name)


def _deployments(app: dict) -> dict[str, dict]:
    return {deployment["name"]: deployment for deployment in app["deployments"]}


def test_dlrm_on_cpu_sets_batching_replicas_cpus_and_torch_threads(template):
    configured = configure_serve_config(template, "dlrm", CONFIGURATION)
    app = _app(configured, "dlrm")
    args = validate_app_args(next(a for a in configured.applications if a.name == "dlrm"))
    assert isinstance(args, DLRMAppConfig)
    assert (args.batching.max_batch_size, args.batching.batch_wait_timeout_s) == (32, 0.02)
    assert args.model.torch_threads == 2  # round(1.6)
    dense = _deployments(app)["DisaggregatedDLRM"]
    assert dense["num_replicas"] == 3
    assert dense["ray_actor_options"] == {"num_cpus": 1.6}
    # The embedding shards keep the template's resources; the other application is untouched.
    assert {name: d for name, d in _deployments(app).items() if name != "DisaggregatedDLRM"} == {
        name: d for name, d in _deployments(_app(template, "dlrm")).items() if name != "DisaggregatedDLRM"
    }
    assert _app(configured, "diffusion") == _app(template, "diffusion")


def test_monolithic_dlrm_targets_the_monolithic_deployment(template):
    raw = template.model_dump(exclude_unset=True)
    next(app for app in raw["applications"] if app["name"] == "dlrm")["args"]["serving"] = "monolithic"
    configured = configure_serve_config(ServeDeploySchema.model_validate(raw), "dlrm", CONFIGURATION)
    mono = _deployments(_app(configured, "dlrm"))["MonolithicDLRM"]
    assert mono == {
        "name": "MonolithicDLRM",
        "num_replicas": 3,
        "ray_actor_options": {"num_cpus": 1.6},
    }


def test_diffusion_on_cpu_sets_engine_rows_torch_threads_and_room_for_full_batches(template):
    configured = configure_serve_config(template, "diffusion", CONFIGURATION | {"torch_threads": 4})
    app = _app(configured, "diffusion")
    args = validate_app_args(next(a for a in configured.applications if a.name == "diffusion"))
    assert isinstance(args, DiffusionAppConfig)
    assert args.engine.max_batch_rows == 32
    assert args.model.torch_threads == 4  # given explicitly, so not round(1.6)
    deployments = _deployments(app)
    assert deployments["DiffusionModel"]["num_replicas"] == 3
    assert deployments["DiffusionModel"]["ray_actor_options"] == {"num_cpus": 1.6}  # threads via args, no env
    assert deployments["DiffusionModel"]["max_ongoing_requests"] == 64
    assert deployments["ImagesIngress"]["max_ongoing_requests"] == 192
    # No diffusion field takes batch_wait_timeout_s: nothing else in args changed.
    template_args = _app(template, "diffusion")["args"]
    assert {key: value for key, value in app["args"].items() if key not in ("engine", "model")} == {
        key: value for key, value in template_args.items() if key not in ("engine", "model")
    }


@pytest.mark.parametrize(
    ("share", "mps", "fraction", "percentage"), [(0.25, True, "0.25", "25"), (2, False, "1.0", None)]
)
def test_gpu_share_requests_fractional_gpus_a_memory_cap_and_mps_percentage(template, share, mps, fraction, percentage):
    configured = configure_serve_config(
        template, "dlrm", CONFIGURATION | {"device_share": share}, accelerator="gpu", mps=mps
    )
    actor = _deployments(_app(configured, "dlrm"))["DisaggregatedDLRM"]["ray_actor_options"]
    assert actor["num_gpus"] == share
    assert actor["num_cpus"] == 0.3  # the template's CPUs stay
    env = actor["runtime_env"]["env_vars"]
    assert env.get("SWIFTSERVE_CUDA_MEMORY_FRACTION") == fraction
    assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == percentage
    assert set(env) <= {"SWIFTSERVE_CUDA_MEMORY_FRACTION", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    args = validate_app_args(next(a for a in configured.applications if a.name == "dlrm"))
    assert args.model.torch_threads is None  # threads only when asked for on GPU


def test_gpu_share_above_one_must_be_whole_gpus(template):
    with pytest.raises(ValueError, match="whole number of GPUs"):
        configure_serve_config(template, "dlrm", CONFIGURATION | {"device_share": 1.5}, accelerator="gpu")


@pytest.mark.parametrize(
    ("change", "field"),
    [({"max_batch_size": 0}, "max_batch_size"), ({"cpus": 2}, "cpus"), ({"device_share": -1}, "device_share")],
)
def test_invalid_configurations_name_the_knob(template, change, field):
    with pytest.raises(ValidationError, match=field):
        configure_serve_config(template, "dlrm", CONFIGURATION | change)


def test_unknown_application_or_import_path_is_refused(template):
    with pytest.raises(ValueError, match=r"no application 'nope'.*diffusion, dlrm"):
        configure_serve_config(template, "nope", CONFIGURATION)
    with pytest.raises(ValueError, match="has no knobs"):
        apply_knobs({"name": "x", "import_path": "other.app:build"}, CONFIGURATION)


def test_autoscaling_gives_way_to_num_replicas_and_the_input_is_not_modified(template):
    app = _app(template, "dlrm")
    app["deployments"][0]["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 4}
    app["deployments"][0].pop("num_replicas")
    configured = apply_knobs(app, CONFIGURATION)
    assert "autoscaling_config" not in configured["deployments"][0]
    assert "autoscaling_config" in app["deployments"][0] and "runtime_env" not in app["deployments"][0]
    ServeDeploySchema.model_validate({"applications": [configured]})


def test_written_yaml_loads_back_and_passes_autoconfig_check(template, tmp_path):
    configured = configure_serve_config(
        template, "dlrm", CONFIGURATION | {"device_share": 0.5}, accelerator="gpu", mps=True
    )
    path = tmp_path / "tuned.yaml"
    write_serve_config(configured, path)
    assert ServeDeploySchema.model_validate(yaml.safe_load(path.read_text())) == configured
    assert load_serve_config(path).model_dump(exclude_unset=True) == configured.model_dump(exclude_unset=True)
    assert autoconfig_main(["check", str(path)]) == 0
