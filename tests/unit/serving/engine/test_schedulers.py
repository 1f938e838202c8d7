"""Per-request schedulers: each name against diffusers' pipeline with that scheduler (``from_config`` of the
pipeline's own scheduler, as one swaps a diffusers scheduler) and the same generators, requests with different
schedulers in one denoiser forward, the clean-latent estimate, and the refusal of an unknown name."""

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)

from serving.common.errors import APIError
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.schedulers import SchedulerChoices
from serving.presets import build_preset
from tests.helpers.denoising import denoise_together, pipeline_images

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale

#: What each name must be: a scheduler class and the config it changes (SD, SDXL: a discrete noise schedule)
DISCRETE = {
    "ddim": (DDIMScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "heun": (HeunDiscreteScheduler, {}),
    "lms": (LMSDiscreteScheduler, {}),
    "pndm": (PNDMScheduler, {"skip_prk_steps": True}),
    "unipc": (UniPCMultistepScheduler, {}),
}
#: SD3 (flow matching, shift 3): its own Euler and the multistep solvers on flow sigmas
FLOW_SOLVER = {"use_flow_sigmas": True, "prediction_type": "flow_prediction", "flow_shift": 3.0}
FLOW = {
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2} | FLOW_SOLVER),
    "euler": (FlowMatchEulerDiscreteScheduler, {}),
    "unipc": (UniPCMultistepScheduler, FLOW_SOLVER),
}
TABLES = {"tiny": DISCRETE, "sdxl-tiny": DISCRETE, "sd3-tiny": FLOW}


@pytest.fixture(scope="module")
def engines() -> dict[str, DiffusionEngine]:
    return {preset: DiffusionEngine(preset, build_preset(preset), CPU) for preset in TABLES}


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=3,
                  guidance_scale=5.0, seed=3, n=2)
    return GenerationParams(**{**values, **overrides})


def _diffusers(preset: str, params: GenerationParams) -> np.ndarray:
    """The request through the preset's diffusers pipeline with the scheduler its name must be."""
    pipe = build_preset(preset).as_pipeline()
    scheduler_cls, changes = TABLES[preset][params.scheduler]
    pipe.scheduler = scheduler_cls.from_config(pipe.scheduler.config, **changes)
    return pipeline_images(pipe, params)


@pytest.mark.parametrize(("preset", "default"), [("tiny", "ddim"), ("sdxl-tiny", "euler"), ("sd3-tiny", "euler")])
def test_a_model_lists_its_schedulers_sorted_and_names_its_own(engines, preset, default):
    info = engines[preset].info
    assert info.schedulers == tuple(sorted(TABLES[preset]))
    assert info.default_scheduler == default


@pytest.mark.parametrize(("preset", "name"), [*[("tiny", name) for name in DISCRETE],
                                              *[("sdxl-tiny", name) for name in ("dpmpp_2m", "euler_a", "heun")],
                                              *[("sd3-tiny", name) for name in FLOW]])
def test_each_scheduler_equals_the_diffusers_pipeline_with_it(engines, preset, name):
    """Every name on SD; on SDXL (the same classes from its Euler config) those with solver state or noise."""
    params = _params(scheduler=name)
    ours = denoise_together(engines[preset], [(params, [])])[0]
    assert np.abs(ours - _diffusers(preset, params)).max() <= TOLERANCE


def test_no_scheduler_is_the_model_own(engines):
    engine = engines["tiny"]
    unnamed, named = denoise_together(engine, [(_params(), []), (_params(scheduler="ddim"), [])])
    assert np.array_equal(unnamed, named)


def test_requests_with_different_schedulers_share_forwards_each_as_diffusers_alone(engines):
    """Heun takes two model evaluations per step, so its request outlives the others in the batch."""
    names = ["ddim", "euler_a", "heun", "dpmpp_2m"]
    requests = [_params(scheduler=name, seed=seed, n=1 + seed % 2) for seed, name in enumerate(names)]
    together = denoise_together(engines["tiny"], [(params, []) for params in requests])
    for ours, params in zip(together, requests, strict=True):
        assert np.abs(ours - _diffusers("tiny", params)).max() <= TOLERANCE
    same_seed = denoise_together(engines["tiny"], [(_params(scheduler=name), []) for name in ("ddim", "euler_a")])
    assert np.abs(same_seed[0] - same_seed[1]).max() > 20 * TOLERANCE  # the scheduler visibly matters


def test_the_clean_latent_estimate_is_the_scheduler_prediction_where_it_has_one(engines):
    engine = engines["tiny"]
    euler, dpm = engine.start(_params(scheduler="euler")), engine.start(_params(scheduler="dpmpp_2m"))
    assert euler.x0_estimate is None and euler.preview_latents is euler.latents
    engine.step([euler, dpm])
    assert euler.x0_estimate is not None and euler.preview_latents is euler.x0_estimate
    assert (euler.x0_estimate - euler.latents).abs().max() > 0.1  # not the noisy latents
    assert dpm.x0_estimate is None and dpm.preview_latents is dpm.latents  # DPM-Solver gives none
    while not euler.done:
        engine.step([euler])
    # Euler's last step goes to sigma 0: its result is its clean-latent estimate
    torch.testing.assert_close(euler.x0_estimate, euler.latents, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("preset", "name"), [("tiny", "dpm++"), ("tiny", "DDIM"), ("sd3-tiny", "euler_a")])
def test_an_unknown_scheduler_is_a_400_listing_the_choices(engines, preset, name):
    engine = engines[preset]
    with pytest.raises(APIError) as refused:
        engine.start(_params(scheduler=name))
    error = refused.value
    assert (error.status_code, error.param, error.code) == (400, "scheduler", "invalid_value")
    assert name in error.message and all(choice in error.message for choice in engine.info.schedulers)


def test_a_model_scheduler_the_table_lacks_is_offered_by_its_class_name():
    own = DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++")  # not the table's dpmpp_2m
    choices = SchedulerChoices(own)
    assert choices.default == "DPMSolverMultistepScheduler"
    assert choices.names == tuple(sorted([*DISCRETE, "DPMSolverMultistepScheduler"]))
    assert choices.build(None).config.algorithm_type == choices.build(choices.default).config.algorithm_type == \
        "sde-dpmsolver++"
    assert choices.build("dpmpp_2m").config.algorithm_type == "dpmsolver++"
