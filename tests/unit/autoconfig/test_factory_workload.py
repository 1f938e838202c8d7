"""A DLRM app serving a user model (``model.factory``): its workload follows the model's signature and id ranges,
presets keep their bodies, and ``autoconfig check`` checks the model (names the key at fault, prints its notes)."""

import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from autoconfig.cli import main as autoconfig_main
from autoconfig.workloads import dlrm_workload, parse_workload_options, workload_for_app
from disagg.api.codec import decode_infer_inputs
from disagg.api.protocol import InferRequest
from disagg.config import DLRMAppConfig, DLRMLimits
from disagg.model_check import check_model
from disagg.model_source import ModelError, model_source
from tests.helpers.factory_apps import app_args, write_model
from tests.helpers.user_models import EXAMPLES, example_serve_config

DLRM_APP = "disagg.app:build_app"


@pytest.fixture
def factory(tmp_path: Path) -> str:
    return write_model(tmp_path)


def test_a_factory_apps_bodies_decode_with_its_signature_and_run_through_the_model(factory):
    args, options = app_args(factory), parse_workload_options("rows_per_request=3,pool_size=4,variable_size=5")
    workload = workload_for_app(DLRM_APP, args, options)
    assert (workload.method, workload.path) == ("POST", "/models/ctr/infer")
    bodies = [workload.body(index) for index in range(5)]
    assert len(set(bodies[:4])) == 4 and bodies[4] == bodies[0]
    config = DLRMAppConfig.model_validate(args)
    report, model = check_model(config), model_source(config.model).build()
    for body in bodies:
        request = InferRequest.model_validate_json(body)
        assert [(tensor.name, tensor.datatype, tensor.shape) for tensor in request.inputs] == [
            ("dense", "FP32", [3, 2]), ("ids", "INT64", [3, 2]), ("history", "INT64", [3, 5])]
        inputs = decode_infer_inputs(request, config.model.signature(), report.id_ranges, DLRMLimits())
        assert int(inputs["ids"][:, 0].max()) < 50 and int(inputs["history"].max()) < 1000
        with torch.no_grad():
            assert model(**inputs).shape == (3, 1)


def test_a_factory_apps_bodies_are_seeded(factory):
    args = app_args(factory)
    plain = workload_for_app(DLRM_APP, args)
    assert workload_for_app(DLRM_APP, args).body(0) == plain.body(0)
    assert workload_for_app(DLRM_APP, args, {"seed": 1}).body(0) != plain.body(0)


def test_a_factory_that_cannot_be_served_is_a_model_error_naming_the_key(factory):
    with pytest.raises(ModelError, match=r"^model\.factory: .*has no attribute 'missing'"):
        workload_for_app(DLRM_APP, app_args(factory.replace(":build", ":missing")))


def test_a_model_that_transforms_its_ids_gets_no_synthetic_requests(tmp_path):
    with pytest.raises(ValueError, match=r"integer input 'ids' has no id range"):
        workload_for_app(DLRM_APP, app_args(write_model(tmp_path, "build_hashed")))


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_shipped_examples_workload_decodes_with_its_signature(name):
    (app,) = example_serve_config(name)["applications"]
    body = workload_for_app(app["import_path"], app["args"], {"rows_per_request": 4, "variable_size": 3}).body(0)
    config = DLRMAppConfig.model_validate(app["args"])
    inputs = decode_infer_inputs(InferRequest.model_validate_json(body), config.model.signature(),
                                 check_model(config).id_ranges, DLRMLimits())
    assert all(tensor.shape[0] == 4 for tensor in inputs.values())


@pytest.mark.parametrize(
    ("args", "options", "digests"),
    [
        ({"model": {"preset": "tiny"}}, {}, ("125dc0ffdc3de05d", "e31daff7b12932be")),
        ({"model": {"preset": "small"}}, {"rows_per_request": 8, "seed": 3}, ("bbfc1472b2c5cfa8", "bc2c2c48fe039a17")),
    ],
)
def test_a_presets_bodies_are_the_ones_the_profile_bank_was_measured_with(args, options, digests):
    workload = workload_for_app(DLRM_APP, args, options)
    assert tuple(hashlib.sha256(workload.body(index)).hexdigest()[:16] for index in (0, 63)) == digests
    # a preset app's args give the preset's bodies too
    assert dlrm_workload(app=args, **options).body(0) == workload.body(0)


def _serve_config(tmp_path: Path, args: dict) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "rec", "route_prefix": "/rec", "import_path": DLRM_APP, "args": args}]}))
    return str(path)


def test_check_names_the_application_and_key_of_a_model_that_cannot_be_served(tmp_path, factory, capsys):
    assert autoconfig_main(["check", _serve_config(tmp_path, app_args(factory.replace(":build", ":missing")))]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "invalid:" in out and "applications[0] (rec): args.model.factory:" in out and "'missing'" in out
    outputs = [{"name": "click", "datatype": "FP32", "shape": [-1, 2]}]
    assert autoconfig_main(["check", _serve_config(tmp_path, app_args(factory, outputs=outputs))]) == 1
    assert "applications[0] (rec): args.model.outputs[0]:" in " ".join(capsys.readouterr().out.split())


def test_check_of_a_good_factory_app_prints_its_model_and_notes(tmp_path, factory, capsys):
    assert autoconfig_main(["check", _serve_config(tmp_path, app_args(factory))]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"rec: model {factory}, 2 embedding table(s)" in out
    assert "note: rec: embedding output" in out and "crosses the cut unpooled" in out
    assert "ok: 1 application(s) valid" in out
