from pathlib import Path

import pytest
import yaml

from autoconfig.cli import main as autoconfig_main
from autoconfig.serve_config import ServeConfigError, load_serve_config
from tests.helpers import REPO

DEFAULT_CONFIG = REPO / "deploy" / "serve_config.yaml"


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_default_config_is_valid_for_ray_and_our_builders():
    config = load_serve_config(DEFAULT_CONFIG)
    assert (config.http_options.host, config.http_options.port) == ("127.0.0.1", 8000)
    routes = {app.name: app.route_prefix for app in config.applications}
    assert routes == {"diffusion": "/", "dlrm": "/v2"}


def test_typo_in_application_args_is_named(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["applications"][0]["args"]["models"][0]["model"]["presett"] = "tiny"
    with pytest.raises(ServeConfigError, match=r"applications\[0\] \(diffusion\): args\.models\[0\]\.model\.presett"):
        load_serve_config(_write(tmp_path, raw))


def test_bad_value_in_application_args_is_named(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["applications"][0]["args"]["models"][1]["defaults"]["num_inference_steps"] = 0  # sdxl-tiny's
    with pytest.raises(ServeConfigError, match=r"args\.models\[1\]\.defaults\.num_inference_steps"):
        load_serve_config(_write(tmp_path, raw))


def test_ray_schema_errors_are_reported(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["http_options"]["port"] = "eighty"
    with pytest.raises(ServeConfigError, match=r"http_options\.port"):
        load_serve_config(_write(tmp_path, raw))


def test_unimportable_builder_is_reported(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["applications"][1]["import_path"] = "disagg.nowhere:build_app"
    with pytest.raises(ServeConfigError, match=r"applications\[1\] \(dlrm\).*disagg.nowhere"):
        load_serve_config(_write(tmp_path, raw))


def test_autoconfig_check_exit_codes(tmp_path, capsys):
    assert autoconfig_main(["check", str(DEFAULT_CONFIG)]) == 0
    assert "2 application(s) valid" in capsys.readouterr().out
    assert autoconfig_main(["check", str(tmp_path / "missing.yaml")]) == 1
    assert "invalid" in capsys.readouterr().out


@pytest.mark.parametrize(("deployment", "user_config", "named"), [
    ("DiffusionModel_tiny", {"max_batch_rows": 4, "batch_wait_timeout_s": 0.01},
     r"deployments\[1\]\.user_config\.batch_wait_timeout_s: the deployment does not read it \(DiffusionModel_tiny's "
     r"user_config takes max_batch_rows, "),
    ("DiffusionModel_tiny", {"max_batch_rows": 0}, r"deployments\[1\]\.user_config\.max_batch_rows: Input should be"),
])
def test_check_refuses_a_user_config_key_the_deployment_does_not_read(tmp_path, capsys, deployment, user_config,
                                                                       named):
    """What a deployment's reconfigure would refuse at deploy time, `autoconfig check` refuses first, naming it."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    entries = raw["applications"][0]["deployments"]
    assert entries[1]["name"] == deployment
    entries[1]["user_config"] = user_config
    with pytest.raises(ServeConfigError, match=r"applications\[0\] \(diffusion\): " + named):
        load_serve_config(_write(tmp_path, raw))
    assert autoconfig_main(["check", str(_write(tmp_path, raw))]) == 1
    assert "invalid" in capsys.readouterr().out


def test_check_accepts_the_dlrm_batching_timer_and_refuses_a_typo_in_it(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    dlrm = next(app for app in raw["applications"] if app["name"] == "dlrm")
    dense = next(entry for entry in dlrm["deployments"] if entry["name"] == "DisaggregatedDLRM")
    dense["user_config"] = {"max_batch_size": 8, "batch_wait_timeout_s": 0.01}
    load_serve_config(_write(tmp_path, raw))
    dense["user_config"] = {"max_batch_size": 8, "batch_wait_timeout": 0.01}
    with pytest.raises(ServeConfigError, match=r"\(dlrm\): deployments\[\d\]\.user_config\.batch_wait_timeout: the "
                                               r"deployment does not read it \(DisaggregatedDLRM's user_config takes "
                                               r"max_batch_size, batch_wait_timeout_s\)"):
        load_serve_config(_write(tmp_path, raw))
