"""The profile bank's models: each names an application of the templates, a workload that application accepts and a
space whose knobs it reads."""

import pytest

from autoconfig.bank import BankEntry
from autoconfig.space import SearchSpace
from autoconfig.study import StudyError, TuningStudy, sqlite_url
from autoconfig.workloads import parse_workload_options, workload_for_app
from benchmarks.profile_bank import (
    BANK,
    MODELS,
    TEMPLATES,
    seed_study,
    slo_calibration_error,
    template_app,
    unloaded_latency_ms,
)
from serving.config import DiffusionAppConfig


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.name)
def test_each_bank_model_names_a_template_app_its_workload_and_a_space_of_its_family(model):
    app = template_app(model.app)  # its args validated by its builder's model (``lora.directory: bundled`` included)
    workload = workload_for_app(app.import_path, app.args, parse_workload_options(model.workload))
    knobs = SearchSpace.from_yaml(TEMPLATES / f"{model.space}_space.yaml").knob_names
    diffusion = app.import_path.startswith("serving.")
    assert workload.path == ("/v1/images/generations" if diffusion else "/models/dlrm/infer")
    # the diffusion engine batches at step boundaries (no batching timer to search); its spaces search torch threads
    searched = ("batch_wait_timeout_s" in knobs, "torch_threads" in knobs)
    assert searched == ((False, True) if diffusion else (True, False))


DIFFUSION = [model for model in MODELS if model.space == "diffusion"]


def test_the_bank_holds_both_families_five_diffusion_models_among_them():
    assert len(DIFFUSION) >= 5 and len(MODELS) - len(DIFFUSION) >= 12
    assert len({model.app for model in DIFFUSION}) >= 4  # tiny, its LoRA-heavy twin, sdxl-tiny, sd3-tiny


@pytest.mark.parametrize("model", DIFFUSION, ids=lambda model: model.name)
def test_each_diffusion_models_requests_are_served_by_its_template_unloaded(model):
    """The latency its SLO was set from, measured as ``--unloaded`` does: every request answered 200."""
    assert unloaded_latency_ms(model, requests=2, warmup=0) > 0


@pytest.mark.parametrize("model", DIFFUSION, ids=lambda model: model.name)
def test_each_diffusion_template_admits_every_request_leaving_the_slo_to_the_rate_search(model):
    """The engine's default admission refuses a 2- or 4-step request behind one or two steps of wait, far inside
    the bank's SLOs: a profile would measure the refusals, not where the SLO breaks."""
    engine = DiffusionAppConfig.model_validate(template_app(model.app).args).engine
    assert (engine.admission_wait_fraction, engine.admission_max_slowdown) == (None, None)


def test_unloaded_latency_refuses_a_dlrm_model_naming_it():
    dlrm = next(model for model in MODELS if model.space == "bank")
    with pytest.raises(ValueError, match=dlrm.name):
        unloaded_latency_ms(dlrm)


def test_a_diffusion_slo_is_checked_against_the_unloaded_latency_of_the_machine_that_profiles():
    model = next(model for model in DIFFUSION if model.slo_p99_ms == 180)
    assert slo_calibration_error(model, 36.0) is None  # 5.0x
    faster = slo_calibration_error(model, 30.0)  # 6.0x: set on a slower machine
    assert faster is not None and model.name in faster and "6.0x" in faster
    slower = slo_calibration_error(model, 45.0)  # 4.0x: set on a faster machine
    assert slower is not None and "4.0x" in slower


def test_a_top_up_that_remeasures_the_starting_point_seeds_the_grid_without_it(tmp_path):
    """``--remeasure-starting``: the entry's trials and repeats are kept and its starting point left out, so that
    ``autoconfig profile`` measures it again beside the best; a study still holding the entry's own is refused."""
    source = next(path for path in sorted(BANK.glob("*.json")) if BankEntry.load(path).starting is not None)
    entry = BankEntry.load(source)
    kept, fresh = sqlite_url(tmp_path / "kept.db"), sqlite_url(tmp_path / "fresh.db")
    seed_study(kept, source)
    assert TuningStudy.load(kept, entry.name).to_bank_entry({"name": entry.name}, {}, "max_rate").starting == (
        entry.starting)
    seed_study(fresh, source, remeasure_starting=True)
    study = TuningStudy.load(fresh, entry.name)
    reseeded = study.to_bank_entry({"name": entry.name}, {}, "max_rate")
    assert study.starting_point() is None
    assert reseeded.trials == entry.trials and reseeded.repeats == entry.repeats
    with pytest.raises(StudyError, match="--remeasure-starting is to measure again: give a --storage"):
        seed_study(kept, source, remeasure_starting=True)
    study.record_starting_point({"status": "ok", "objective": 1.0, "reference_config": {}, "reference_objective": 2.0})
    seed_study(fresh, source, remeasure_starting=True)  # an interrupted top-up resumes: its starting point stays
    assert TuningStudy.load(fresh, entry.name).starting_point()["reference_objective"] == 2.0
