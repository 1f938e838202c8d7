"""The trained `tiny` preset does what its prompt, ControlNet and LoRAs ask, through our engine's paths.

Images are judged by the shapes-world measures (``training.shapes.evaluation``): dominant colour, a random
forest on silhouettes, mask IoU against the edge map's shape, outline score and background darkness. Every
check compares with a control (guidance 1, no ControlNet, no LoRA), so a bug that sends residuals to the wrong
block or applies a LoRA at the wrong scale fails here even though the images are still images.
"""

import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from serving.config import EngineConfig
from serving.controlnet.client import LocalControlNets
from serving.controlnet.models import build_controlnet_preset, controlnet_preset_weights
from serving.controlnet.runner import ControlNetRunner
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, LoRASpec
from serving.engine.cfg import LocalCFGWorker
from serving.engine.request import PendingLoRA
from serving.engine.types import ControlNetSpec
from serving.lora.cache import LoRACache
from serving.lora.format import load_lora_file
from serving.lora.registry import LoRARegistry
from serving.preset_catalog import preset_weights
from serving.presets import build_preset
from tests.helpers.held_loras import prepared
from tests.helpers.images import decode_png
from training.shapes import evaluation
from training.shapes.evaluation import EVALUATION_GUIDANCE, EVALUATION_STEPS
from training.shapes.world import STYLE_WORLDS

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
WEIGHTS = preset_weights("tiny")
FIDELITY_BRIEFS = 30  # every (colour, shape) pair once
CONTROL_BRIEFS = 12
STYLE_BRIEFS = 12
MIN_CONTROL_IOU = 0.5
CONTROL_IOU_MARGIN = 0.25  # "clearly lower" without the ControlNet
GUIDANCE_MARGIN = 0.05  # on colour vote share + shape probability (each in [0, 1])
MIN_STYLE_SHIFT = {"outlined": ("outline", 0.25), "dark": ("darkness", 0.5)}


def _engine(**extra) -> DiffusionEngine:
    """The trained model with the trained `edges` ControlNet in process."""
    controlnets = LocalControlNets({"edges": ControlNetRunner(build_controlnet_preset("tiny", weights="auto"), CPU)})
    return DiffusionEngine("tiny", build_preset("tiny", weights="auto"), CPU, controlnets=controlnets, **extra)


@pytest.fixture(scope="module")
def engine() -> DiffusionEngine:
    return _engine()


def _params(brief: evaluation.Brief, seed: int, *, guidance: float = EVALUATION_GUIDANCE, control: bool = False,
            loras: tuple[LoRASpec, ...] = (), steps: int = EVALUATION_STEPS) -> GenerationParams:
    return GenerationParams(
        prompt=brief.prompt, width=64, height=64, num_inference_steps=steps, guidance_scale=guidance,
        seed=seed, loras=loras, controlnets=(ControlNetSpec("edges", brief.control),) if control else ())


def _pending(engine: DiffusionEngine, style: str, scale: float) -> PendingLoRA:
    future: Future = Future()
    future.set_result(load_lora_file(WEIGHTS / "loras" / f"{style}.safetensors", engine.lora_targets,
                                     max_file_bytes=2**30))
    return PendingLoRA(name=style, scale=scale, load=future, cache_hit=True)


def _generate(engine: DiffusionEngine, briefs: list[evaluation.Brief], *, lora: tuple[str, float] | None = None,
              **options) -> list[np.ndarray]:
    """All briefs as one batch of requests (image i from seed i), stepped together to the end."""
    states = []
    for seed, brief in enumerate(briefs):
        pending = [_pending(engine, *lora)] if lora else []
        states.append(engine.start(_params(brief, seed, **options), pending))
        if pending:
            engine.activate_loras(states[-1])
    while not all(state.done for state in states):
        engine.step([state for state in states if not state.done])
    return evaluation.to_uint8([engine.decode(state)[0] for state in states])


@pytest.fixture(scope="module")
def fidelity_briefs() -> list[evaluation.Brief]:
    return evaluation.briefs(FIDELITY_BRIEFS)


@pytest.fixture(scope="module")
def control_briefs() -> list[evaluation.Brief]:
    return evaluation.briefs(CONTROL_BRIEFS, stream=evaluation.EVALUATION_STREAM + 1)


@pytest.fixture(scope="module")
def style_briefs() -> list[evaluation.Brief]:
    return evaluation.briefs(STYLE_BRIEFS, short=True, stream=evaluation.EVALUATION_STREAM + 2)


@pytest.fixture(scope="module")
def guided(engine, fidelity_briefs) -> dict[str, float]:
    return evaluation.fidelity(_generate(engine, fidelity_briefs), fidelity_briefs)


@pytest.fixture(scope="module")
def controlled(engine, control_briefs) -> list[np.ndarray]:
    return _generate(engine, control_briefs, control=True)


@pytest.fixture(scope="module")
def plain_style(engine, style_briefs) -> list[np.ndarray]:
    return _generate(engine, style_briefs)


# -- shipped files ---------------------------------------------------------------------------------------


def test_shipped_weights_are_the_presets_architecture_in_diffusers_layout_within_25_mb():
    assert WEIGHTS is not None and controlnet_preset_weights("tiny") is not None
    total = sum(path.stat().st_size for path in Path(WEIGHTS).rglob("*") if path.is_file())
    assert total <= 25 * 2**20
    trained, seeded = build_preset("tiny", weights="auto"), build_preset("tiny", weights="seeded")
    for name, module in trained.modules().items():
        shapes = {key: tuple(value.shape) for key, value in module.state_dict().items()}
        assert shapes == {key: tuple(value.shape) for key, value in seeded.modules()[name].state_dict().items()}
        assert all(p.dtype == torch.float32 for p in module.parameters())  # stored fp16, served fp32
    assert trained.tokenizer.get_vocab() == seeded.tokenizer.get_vocab()
    for style in STYLE_WORLDS:
        with safe_open(WEIGHTS / "loras" / f"{style}.safetensors", "pt") as lora:
            keys = list(lora.keys())
        assert keys and all(key.startswith("unet.") for key in keys)


def test_seeded_weights_are_still_available_and_differ_from_the_trained_ones():
    trained = build_preset("tiny", weights="auto").denoiser.state_dict()
    seeded = build_preset("tiny", seed=0).denoiser.state_dict()
    assert not torch.equal(trained["conv_in.weight"], seeded["conv_in.weight"])


# -- prompt fidelity ---------------------------------------------------------------------------------------


def test_prompt_colour_and_shape_are_generated(guided):
    assert guided["colour"] >= 0.8, guided
    assert guided["shape"] >= 0.6, guided


def test_guidance_above_one_scores_higher_than_guidance_one(engine, fidelity_briefs, guided):
    """On the hit rates, and on the finer scores (asked colour's vote share, asked shape's probability)."""
    unguided = evaluation.fidelity(_generate(engine, fidelity_briefs, guidance=1.0), fidelity_briefs)
    assert guided["colour"] + guided["shape"] >= unguided["colour"] + unguided["shape"], (guided, unguided)
    assert (guided["colour_share"] + guided["shape_probability"]
            > unguided["colour_share"] + unguided["shape_probability"] + GUIDANCE_MARGIN), (guided, unguided)


# -- ControlNet ----------------------------------------------------------------------------------------------


def test_controlnet_puts_the_shape_where_the_edge_map_is(engine, control_briefs, controlled):
    with_control = evaluation.control_iou(controlled, control_briefs)
    without = evaluation.control_iou(_generate(engine, control_briefs), control_briefs)
    assert with_control >= MIN_CONTROL_IOU, (with_control, without)
    assert without <= with_control - CONTROL_IOU_MARGIN, (with_control, without)


def test_controlnet_with_parallel_cfg_worker(control_briefs, controlled):
    worker = LocalCFGWorker(_engine())  # the unconditional rows need the ControlNet residuals too
    try:
        images = _generate(_engine(cfg_worker=worker), control_briefs, control=True)
    finally:
        worker.close()
    assert evaluation.control_iou(images, control_briefs) >= MIN_CONTROL_IOU
    assert max(np.abs(a.astype(int) - b.astype(int)).max() for a, b in zip(images, controlled, strict=True)) <= 2


def test_controlnet_through_continuous_batching(engine, control_briefs):
    """Requests join the running batch at different steps (each arrives when the previous is at step 3)."""
    arrived = threading.Event()

    def on_step(state):
        if state.step_index == 3:
            arrived.set()

    loop = EngineLoop(engine, EngineConfig(continuous_batching=True, max_batch_rows=64), None, on_step=on_step)
    try:
        futures = []
        for seed, brief in enumerate(control_briefs):
            arrived.clear()
            futures.append(loop.submit(_params(brief, seed, control=True)))
            arrived.wait(timeout=60)
        images = [decode_png(future.result(timeout=300).images[0]) for future in futures]
    finally:
        loop.stop()
    assert evaluation.control_iou(images, control_briefs) >= MIN_CONTROL_IOU


# -- LoRAs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", list(STYLE_WORLDS))
def test_style_lora_moves_its_measure_and_keeps_the_prompt(engine, style_briefs, plain_style, style):
    measure, margin = MIN_STYLE_SHIFT[style]
    styled = _generate(engine, style_briefs, lora=(style, 1.0))
    before, after = evaluation.style(plain_style)[measure], evaluation.style(styled)[measure]
    assert after >= before + margin, (style, before, after)
    assert evaluation.fidelity(styled, style_briefs)["colour"] >= 0.75


@pytest.mark.parametrize("style", list(STYLE_WORLDS))
def test_trained_lora_in_the_engine_equals_diffusers_loading_it(engine, style_briefs, style):
    """The shipped files (PEFT keys on attention and ResNet convolutions) as diffusers applies them."""
    brief, scale = style_briefs[0], 0.7
    ours = _generate(engine, [brief], lora=(style, scale), guidance=5.0)[0]
    pipe = build_preset("tiny", weights="auto").as_pipeline()
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(WEIGHTS / "loras", weight_name=f"{style}.safetensors", adapter_name=style)
    pipe.set_adapters([style], [scale])
    reference = pipe(prompt=brief.prompt, num_inference_steps=EVALUATION_STEPS, guidance_scale=5.0,
                     generator=torch.Generator().manual_seed(0), output_type="np").images
    assert np.abs(ours.astype(int) - evaluation.to_uint8(reference)[0].astype(int)).max() <= 1


@pytest.mark.parametrize("style", list(STYLE_WORLDS))
def test_lora_scale_zero_equals_no_lora(engine, style_briefs, style):
    """Bit-equal images: the same batch (composition changes float rounding) with and without the LoRA (4 steps:
    equality needs no more)."""
    images = _generate(engine, style_briefs[:4], lora=(style, 0.0), steps=4)
    plain = _generate(engine, style_briefs[:4], steps=4)
    assert all(np.array_equal(a, b) for a, b in zip(images, plain, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(_generate(engine, style_briefs[:4], lora=(style, 0.5), steps=4),
                                                          plain, strict=True))


def test_lora_applied_asynchronously_still_moves_the_style(engine, style_briefs, plain_style):
    """The LoRA file loads in the background; the request starts without it and gets it at a later step."""
    release = threading.Event()

    def slow_loader(path):
        release.wait(timeout=60)
        return load_lora_file(path, engine.lora_targets, max_file_bytes=2**30)

    def on_step(state):
        if state.step_index == 2:
            release.set()
            prepared(state)

    cache = LoRACache(LoRARegistry(WEIGHTS / "loras"), engine.lora_targets, budget_bytes=2**30,
                      max_file_bytes=2**30, loader=slow_loader)
    loop = EngineLoop(engine, EngineConfig(lora_wait_fraction=0.5, admission_wait_fraction=None), cache,
                      on_step=on_step)  # every brief at once: more than one batch
    try:
        futures = [loop.submit(_params(brief, seed, loras=(LoRASpec("dark", 1.0),)))
                   for seed, brief in enumerate(style_briefs)]
        results = [future.result(timeout=300) for future in futures]
    finally:
        loop.stop()
    applied = [result.lora.applied_at_step for result in results]
    late = [i for i, step in enumerate(applied) if step > 0]  # started denoising without the LoRA
    assert applied[0] == 2 and all(step <= 2 for step in applied), applied
    images = [decode_png(results[i].images[0]) for i in late]
    measure, margin = MIN_STYLE_SHIFT["dark"]
    before = evaluation.style([plain_style[i] for i in late])[measure]
    assert evaluation.style(images)[measure] >= before + margin, (late, before)
