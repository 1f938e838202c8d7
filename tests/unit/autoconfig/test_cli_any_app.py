"""`autoconfig tune` on an app of the user's own refuses bad input before any trial (and without Ray): a workload
line that is not JSON, a knob naming no listed deployment, a value Serve refuses, a missing space or workload."""

import pytest
import yaml

from autoconfig.cli import main

MODULE = "swiftserve_unit_user_app"  # not importable here: its runtime_env would bring it
SPACE = {"knobs": {"Echo.num_replicas": {"values": [1]}, "Echo.user_config.delay_ms": {"values": [2, 400]}}}


def _argv(tmp_path, space: dict, workload: str) -> list[str]:
    config, space_file, workload_file = tmp_path / "serve.yaml", tmp_path / "space.yaml", tmp_path / "w.jsonl"
    config.write_text(yaml.safe_dump({"applications": [{
        "name": "echo", "route_prefix": "/echo", "import_path": f"{MODULE}:app",
        "runtime_env": {"working_dir": "local:///nonexistent"}, "deployments": [{"name": "Echo"}]}]}))
    space_file.write_text(yaml.safe_dump(space))
    workload_file.write_text(workload)
    return ["tune", "--config", str(config), "--app", "echo", "--workload", str(workload_file), "--space",
            str(space_file), "--slo-p99-ms", "200", "--storage", f"sqlite:///{tmp_path / 's.db'}"]


def _refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    return " ".join(capsys.readouterr().out.split())


def test_a_workload_line_that_is_not_json_is_named(tmp_path, capsys):
    assert "w.jsonl:2: not JSON" in _refused(_argv(tmp_path, SPACE, '{"path": "/"}\n{"path": "/", body}\n'), capsys)


def test_a_knob_naming_no_listed_deployment_or_option_is_named(tmp_path, capsys):
    space = {"knobs": {"Model.num_replicas": {"values": [1, 2]}}}
    out = _refused(_argv(tmp_path, space, '{"path": "/"}\n'), capsys)
    assert "knobs.Model.num_replicas: application 'echo' lists no deployment 'Model'" in out
    space = {"knobs": {"Echo.ray_actor_options.cpus": {"values": [1]}}}
    out = _refused(_argv(tmp_path, space, '{"path": "/"}\n'), capsys)
    assert "knobs.Echo.ray_actor_options.cpus: 'cpus' is not an option of ray_actor_options" in out


def test_a_value_serve_refuses_is_named_with_its_knob(tmp_path, capsys):
    space = {"knobs": {"Echo.max_ongoing_requests": {"values": [4, 0]}}}
    out = _refused(_argv(tmp_path, space, '{"path": "/"}\n'), capsys)
    assert "knobs.Echo.max_ongoing_requests.values[0] = 0: Serve refuses it" in out


def test_shortcuts_need_a_built_in_app_and_any_app_needs_a_space_and_a_workload_file(tmp_path, capsys):
    shortcuts = {"knobs": {"max_batch_size": {"values": [1]}, "batch_wait_timeout_s": {"values": [0.0]},
                           "device_share": {"values": [1.0]}, "num_replicas": {"values": [1]}}}
    out = _refused(_argv(tmp_path, shortcuts, '{"path": "/"}\n'), capsys)
    assert f"knobs.max_batch_size: import_path '{MODULE}:app' has no shortcut knobs" in out
    argv = _argv(tmp_path, SPACE, '{"path": "/"}\n')
    out = _refused([*argv[:5], *argv[7:]], capsys)  # no --workload
    assert "is not a built-in app: give --space FILE.yaml" in out


def test_an_app_is_left_to_serve_to_import_only_when_its_runtime_env_brings_code():
    from autoconfig.serve_config import ServeConfigError, parse_serve_config

    app = {"name": "echo", "route_prefix": "/echo", "import_path": f"{MODULE}:app", "args": {"any": 1}}
    shipped = parse_serve_config({"applications": [app | {"runtime_env": {"py_modules": ["local:///opt/code"]}}]})
    assert shipped.applications[0].args == {"any": 1}  # unvalidated here: Serve builds it in its runtime_env
    with pytest.raises(ServeConfigError, match=f"No module named '{MODULE}'"):
        parse_serve_config({"applications": [app | {"runtime_env": {"env_vars": {"A": "1"}}}]})
