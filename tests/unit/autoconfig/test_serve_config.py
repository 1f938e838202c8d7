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
