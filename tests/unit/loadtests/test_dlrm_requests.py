"""The load test's DLRM requests: a preset's by default, or those of the model a Serve config's app serves (through
autoconfig's workload), and the checks of the responses (no locust, no Ray)."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from autoconfig.workloads import workload_for_app
from disagg.api.codec import decode_infer_inputs
from disagg.api.protocol import InferRequest
from disagg.config import DLRMAppConfig, DLRMLimits
from disagg.model_check import check_model
from disagg.signature import OutputSignature
from loadtests.dlrm_requests import output_problem, settings_target
from loadtests.settings import Settings
from tests.helpers.factory_apps import app_args, write_model


def _settings(**options: str) -> Settings:
    return Settings.from_options(SimpleNamespace(**options))


def test_by_default_the_requests_are_the_presets_autoconfig_sends():
    target = settings_target(_settings(dlrm_rows="3", dlrm_pool="2", dlrm_preset="small", dlrm_model="m",
                                       dlrm_prefix="/api/"), seed=5)
    assert target.path == "/api/models/m/infer" and target.probabilities
    assert [output.name for output in target.outputs] == ["probabilities"]
    autoconfig = workload_for_app("disagg.app:build_app", {"model": {"preset": "small"}},
                                  {"rows_per_request": 3, "pool_size": 2, "seed": 5})
    assert [target.workload.body(index) for index in range(2)] == [autoconfig.body(index) for index in range(2)]


@pytest.fixture
def serve_config(tmp_path) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "rec", "route_prefix": "/rec", "import_path": "disagg.app:build_app",
         "args": app_args(write_model(tmp_path))},
        {"name": "images", "route_prefix": "/", "import_path": "serving.app:build_app", "args": {}},
    ]}))
    return str(path)


def test_a_serve_configs_app_gives_its_models_requests_path_and_outputs(serve_config):
    settings = _settings(dlrm_serve_config=serve_config, dlrm_app="rec", dlrm_rows="3", dlrm_variable_size="4",
                         dlrm_prefix="/ignored", dlrm_model="ignored")
    target = settings_target(settings, seed=0)
    assert target.path == "/rec/models/ctr/infer" and not target.probabilities
    assert [output.name for output in target.outputs] == ["click"]
    args = yaml.safe_load(Path(serve_config).read_text())["applications"][0]["args"]
    config = DLRMAppConfig.model_validate(args)
    inputs = decode_infer_inputs(InferRequest.model_validate_json(target.workload.body(0)), config.model.signature(),
                                 check_model(config).id_ranges, DLRMLimits())
    assert inputs["history"].shape == (3, 4) and inputs["dense"].shape == (3, 2)


@pytest.mark.parametrize(
    ("app", "message"),
    [("other", r"no application 'other'; applications: rec, images"),
     ("images", r"application 'images' runs serving.app:build_app, not disagg.app:build_app")],
)
def test_an_app_that_is_not_a_dlrm_app_of_the_config_is_named(serve_config, app, message):
    with pytest.raises(ValueError, match=message):
        settings_target(_settings(dlrm_serve_config=serve_config, dlrm_app=app), seed=0)


def test_the_new_options_parse_and_default():
    settings = _settings()
    assert (settings.dlrm_serve_config, settings.dlrm_app, settings.dlrm_variable_size) == (None, "dlrm", 1)


CLICK = OutputSignature(name="click", datatype="FP32", shape=[-1, 2])


@pytest.mark.parametrize(
    ("output", "probabilities", "problem"),
    [
        ({"shape": [3, 2], "data": [0.5] * 6}, True, None),
        ({"shape": [3, 2], "data": [2.0] * 6}, False, None),
        ({"shape": [3, 2], "data": [2.0] * 6}, True, "click outside [0, 1]"),
        ({"shape": [2, 2], "data": [0.5] * 4}, False, "expected click of shape [3, 2], got shape [2, 2] with 4 values"),
        ({"shape": [3, 1], "data": [0.5] * 3}, False, "expected click of shape [3, 2]"),
        ({"shape": [3, 2, 1], "data": [0.5] * 6}, False, "expected click of shape [3, 2]"),
        ({"shape": [3, 2], "data": [0.5] * 5}, False, "got shape [3, 2] with 5 values"),
        ({"shape": [3, 2], "data": [math.nan] * 6}, False, "click: values not finite"),
    ],
)
def test_output_problems_are_named(output, probabilities, problem):
    found = output_problem(output, CLICK, 3, probabilities)
    assert found == problem if problem is None else problem in found


def test_a_variable_output_dimension_takes_any_size():
    variable = OutputSignature(name="scores", shape=[-1, -1])
    assert output_problem({"shape": [3, 7], "data": [0.0] * 21}, variable, 3, False) is None
