"""The profile bank's models: each names an application of the templates, a workload that application accepts and a
space whose knobs it reads."""

import pytest

from autoconfig.serve_config import load_serve_config
from autoconfig.space import SearchSpace
from autoconfig.workloads import parse_workload_options, workload_for_app
from benchmarks.profile_bank import MODELS, TEMPLATES

#: Parsed and validated, every application's args by its builder's model (``lora.directory: bundled`` included).
APPS = {app.name: app for app in load_serve_config(TEMPLATES / "serve_config.yaml").applications}


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.name)
def test_each_bank_model_names_a_template_app_its_workload_and_a_space_of_its_family(model):
    app = APPS[model.app]
    workload = workload_for_app(app.import_path, app.args, parse_workload_options(model.workload))
    knobs = SearchSpace.from_yaml(TEMPLATES / f"{model.space}_space.yaml").knob_names
    diffusion = app.import_path.startswith("serving.")
    assert workload.path == ("/v1/images/generations" if diffusion else "/models/dlrm/infer")
    # the diffusion engine batches at step boundaries (no batching timer to search); its spaces search torch threads
    searched = ("batch_wait_timeout_s" in knobs, "torch_threads" in knobs)
    assert searched == ((False, True) if diffusion else (True, False))
