"""GPU shares: the mode a tuning run uses (MPS where every GPU node's daemon answers), the environment each mode
writes, and configs whose shares overflow a GPU refused by ``autoconfig check`` and ``tune``."""

import stat
from pathlib import Path
from typing import get_args

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from autoconfig.cli import GPU_SHARE_MODE_NAMES
from autoconfig.cli import main as autoconfig_main
from autoconfig.gpu_share import (
    GpuShareError,
    GpuShareMode,
    gpu_overcommit,
    gpu_share_env,
    mps_daemon_answers,
    resolve_gpu_share_mode,
)
from tests.helpers import REPO


def test_the_command_line_offers_every_mode():
    assert get_args(GpuShareMode) == GPU_SHARE_MODE_NAMES


@pytest.mark.parametrize(("share", "mode", "env"), [
    (0.25, "mps", {"SWIFTSERVE_CUDA_MEMORY_FRACTION": "0.25", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}),
    (0.004, "mps", {"SWIFTSERVE_CUDA_MEMORY_FRACTION": "0.004", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1"}),
    (2.0, "mps", {"SWIFTSERVE_CUDA_MEMORY_FRACTION": "1.0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}),
    (0.5, "memory", {"SWIFTSERVE_CUDA_MEMORY_FRACTION": "0.5"}),
    (0.5, "schedule", {}),
])
def test_each_mode_writes_what_it_divides(share, mode, env):
    assert gpu_share_env(share, mode) == env


def _fake_control(directory: Path, script: str) -> None:
    control = directory / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\n" + script)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)


def test_a_daemon_that_answers_through_its_control_pipe(tmp_path, monkeypatch):
    _fake_control(tmp_path, 'read command; [ "$command" = get_server_list ] && echo 4242\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert mps_daemon_answers() is None


def test_no_daemon_or_no_control_binary_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert mps_daemon_answers() == "nvidia-cuda-mps-control is not on PATH"
    _fake_control(tmp_path, "echo 'Cannot find MPS control daemon process' >&2; exit 1\n")
    assert mps_daemon_answers() == ("no MPS control daemon answers (nvidia-cuda-mps-control: exit 1, Cannot find "
                                    "MPS control daemon process)")
    _fake_control(tmp_path, "exec /bin/sleep 5\n")  # PATH holds only the fake
    assert mps_daemon_answers(timeout_s=0.2) == "nvidia-cuda-mps-control did not answer within 0.2 s"


def _never_asked() -> dict[str, str]:
    raise AssertionError("the nodes were probed although the mode needs no daemon")


def test_the_default_is_mps_where_every_gpu_node_answers_else_memory_with_a_warning():
    assert resolve_gpu_share_mode(None, lambda: {}) == ("mps", None)
    mode, warning = resolve_gpu_share_mode(None, lambda: {"node-b": "nvidia-cuda-mps-control is not on PATH"})
    assert mode == "memory"
    assert warning.startswith("--gpu-share-mode memory: device_share divides GPU memory, not compute")
    assert "node node-b: nvidia-cuda-mps-control is not on PATH" in warning
    assert resolve_gpu_share_mode("memory", _never_asked) == ("memory", None)
    assert resolve_gpu_share_mode("schedule", _never_asked) == ("schedule", None)


def test_mps_asked_for_where_a_daemon_does_not_answer_is_refused_naming_the_node():
    assert resolve_gpu_share_mode("mps", lambda: {}) == ("mps", None)
    with pytest.raises(GpuShareError, match=r"^--gpu-share-mode mps: node n1: no MPS control daemon answers; node n2: "
                                            r"x; start the daemon on every GPU node"):
        resolve_gpu_share_mode("mps", lambda: {"n2": "x", "n1": "no MPS control daemon answers"})


def _config(*deployments: dict, app_env: dict | None = None) -> dict:
    app = {"name": "app", "import_path": "somewhere.app:build", "route_prefix": "/",
           "deployments": [{"name": f"D{i}", **deployment} for i, deployment in enumerate(deployments)]}
    if app_env:
        app["runtime_env"] = {"env_vars": app_env}
    return {"applications": [app]}


def _gpu(share: float, replicas: int, **env: str) -> dict:
    options = {"num_gpus": share} | ({"runtime_env": {"env_vars": env}} if env else {})
    return {"num_replicas": replicas, "ray_actor_options": options}


def _overcommit(config: dict) -> str | None:
    return gpu_overcommit(ServeDeploySchema.model_validate(config))


def test_shares_equal_to_num_gpus_never_overflow():
    assert _overcommit(_config(_gpu(0.25, 4, SWIFTSERVE_CUDA_MEMORY_FRACTION="0.25",
                                    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25"), _gpu(0.5, 3))) is None
    assert _overcommit(_config(_gpu(1.0, 2, SWIFTSERVE_CUDA_MEMORY_FRACTION="1.0"))) is None  # whole GPUs each


def test_replicas_that_ray_may_pack_on_one_gpu_past_its_whole_are_named():
    # Four replicas at num_gpus 0.25 fit one GPU, but each claims half of its memory.
    message = _overcommit(_config(_gpu(0.25, 4, SWIFTSERVE_CUDA_MEMORY_FRACTION="0.5")))
    assert message.startswith("4 x app/D0 (num_gpus 0.25, share 0.5) fit one GPU by num_gpus but claim 2.00 of it")
    # An MPS percentage counts too; one replica over its share is harmless alone, not beside a full neighbour.
    assert _overcommit(_config(_gpu(0.5, 1, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="60"))) is None
    mixed = _overcommit(_config(_gpu(0.5, 1, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="60"), _gpu(0.5, 1)))
    assert "1 x app/D0 (num_gpus 0.5, share 0.6) + 1 x app/D1 (num_gpus 0.5, share 0.5)" in mixed
    assert "claim 1.10 of it" in mixed
    # The app's environment applies to every deployment's replicas.
    assert _overcommit(_config(_gpu(0.5, 2), app_env={"SWIFTSERVE_CUDA_MEMORY_FRACTION": "0.7"})) is not None


def test_a_share_that_is_not_a_number_names_the_variable():
    with pytest.raises(ValueError, match=r"app/D0: runtime_env\.env_vars\.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 'lots' "
                                         r"is not a number"):
        _overcommit(_config(_gpu(0.5, 1, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="lots")))


def test_check_refuses_a_config_whose_shares_overflow_a_gpu(tmp_path, capsys):
    raw = yaml.safe_load((REPO / "deploy" / "serve_config.gpu.yaml").read_text())
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert autoconfig_main(["check", str(path)]) == 0
    model = next(entry for app in raw["applications"] for entry in app.get("deployments", [])
                 if entry.get("ray_actor_options", {}).get("num_gpus"))
    model["num_replicas"] = 4
    model["ray_actor_options"]["num_gpus"] = 0.25
    model["ray_actor_options"].setdefault("runtime_env", {}).setdefault("env_vars", {})[
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "50"
    path.write_text(yaml.safe_dump(raw))
    assert autoconfig_main(["check", str(path)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"4 x diffusion/{model['name']} (num_gpus 0.25, share 0.5) fit one GPU by num_gpus but claim 2.00" in out
