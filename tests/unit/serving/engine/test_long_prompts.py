"""Weighted and long prompts through the engine's prompt encoders: equal to compel's embeddings where compel covers
the family (``CompelForSD`` on ``tiny``, ``CompelForSDXL`` on ``sdxl-tiny``, ``CompelForFlux`` on ``flux-tiny``),
images equal to diffusers' pipelines given compel's embeddings, SD3's CLIP windows before its T5 window, requests
of different text lengths batched apart, and every prompt without emphasis or past-window text encoded exactly as
before."""

import numpy as np
import pytest
import torch
from compel import CompelForFlux, CompelForSD, CompelForSDXL

from serving.config import EngineConfig
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams
from serving.engine.emphasis import joined_text, parse_emphasis
from serving.presets import build_preset
from tests.helpers.denoising import denoise_together, loaded_lora, pipeline_images
from tests.helpers.images import decode_png
from tests.helpers.lora_files import write_lora

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale
#: 12 phrases of 7 tokens and a sentence after them: two CLIP windows, split at the sentence's start
LONG = ", ".join(["a red circle on a white background"] * 12) + ". green triangles on a blue square"
#: (ours, compel's spelling of the same weights)
WEIGHTED = [
    ("a (red circle:1.3) on a (white background:0.8)", "a (red circle)1.3 on a (white background)0.8"),
    (LONG, LONG),
    (LONG + " and (green triangles:1.2)", LONG + " and (green triangles)1.2"),
]
WEIGHTED_IDS = ["weighted", "long", "long-weighted"]
#: prompts whose markup leaves plain text within the window: an unpaired bracket, escaped brackets
PLAIN_PROMPTS = ["a red circle on a white background", "a red circle :) [on a white", r"a \(red\) circle"]
PLAIN_IDS = ["plain", "unpaired", "escaped"]


def _engine(preset: str, **kwargs) -> DiffusionEngine:
    return DiffusionEngine(preset, build_preset(preset), CPU, **kwargs)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=2,
                  guidance_scale=5.0, seed=3, negative_prompt="a blue square")
    return GenerationParams(**{**values, **overrides})


@pytest.mark.parametrize(("ours", "theirs"), WEIGHTED, ids=WEIGHTED_IDS)
def test_sd_embeddings_equal_compels(ours, theirs):
    engine = _engine("tiny")
    prompt, negative = engine.prompts.encode(_params(prompt=ours))
    with torch.inference_mode():
        reference = CompelForSD(build_preset("tiny").as_pipeline())(theirs, negative_prompt="a blue square")
    torch.testing.assert_close(prompt.hidden, reference.embeds)
    torch.testing.assert_close(negative.hidden, reference.negative_embeds)  # padded to the prompt's windows


@pytest.mark.parametrize(("ours", "theirs"), WEIGHTED, ids=WEIGHTED_IDS)
def test_sdxl_embeddings_equal_compels_and_the_pooled_one_is_the_plain_texts(ours, theirs):
    """compel pools the prompt as written, its weight markup included; the engine pools the text the markup leaves
    (its first window), as diffusers encodes that text."""
    engine = _engine("sdxl-tiny")
    prompt, negative = engine.prompts.encode(_params(prompt=ours))
    pipe = build_preset("sdxl-tiny").as_pipeline()
    with torch.inference_mode():
        reference = CompelForSDXL(pipe)(theirs, negative_prompt="a blue square")
        plain = pipe.encode_prompt(prompt=joined_text(parse_emphasis(ours)), negative_prompt="a blue square",
                                   device=CPU, num_images_per_prompt=1, do_classifier_free_guidance=True)
    torch.testing.assert_close(prompt.hidden, reference.embeds)
    torch.testing.assert_close(negative.hidden, reference.negative_embeds)
    torch.testing.assert_close(prompt.added["text_embeds"], plain[2])
    torch.testing.assert_close(negative.added["text_embeds"], plain[3])


@pytest.mark.parametrize(("ours", "theirs"), WEIGHTED, ids=WEIGHTED_IDS)
def test_flux_embeddings_equal_compels(ours, theirs):
    """Flux: the T5 states weighted within their one window, the CLIP pooled output of the unweighted text."""
    engine = _engine("flux-tiny")
    params = _params(prompt=ours, guidance_scale=3.5, true_cfg=True, true_cfg_scale=2.0)
    prompt, negative = engine.prompts.encode(params)
    with torch.inference_mode():
        reference = CompelForFlux(build_preset("flux-tiny").as_pipeline())(theirs, negative_prompt="a blue square")
    torch.testing.assert_close(prompt.hidden, reference.embeds)
    torch.testing.assert_close(prompt.added["pooled_projections"], reference.pooled_embeds)
    torch.testing.assert_close(negative.hidden, reference.negative_embeds)
    torch.testing.assert_close(negative.added["pooled_projections"], reference.negative_pooled_embeds)
    assert prompt.hidden.shape[1] == engine.prompts.usual_length  # one T5 window, long or not


def test_an_image_from_a_long_weighted_prompt_equals_diffusers_given_compels_embeddings():
    ours, theirs = WEIGHTED[2]
    params = _params(prompt=ours)
    image = denoise_together(_engine("tiny"), [(params, [])])[0]
    pipe = build_preset("tiny").as_pipeline()
    with torch.inference_mode():
        reference = CompelForSD(pipe)(theirs, negative_prompt=params.negative_prompt)
    expected = pipeline_images(pipe, params, prompt_embeds=reference.embeds,
                               negative_prompt_embeds=reference.negative_embeds)
    assert np.abs(image - expected).max() <= TOLERANCE


@pytest.mark.parametrize(("ours", "theirs"), WEIGHTED[:2], ids=WEIGHTED_IDS[:2])
def test_a_long_or_weighted_prompt_without_a_negative_prompt_has_compels_empty_negative(ours, theirs):
    engine = _engine("tiny")
    ours, negative = engine.prompts.encode(_params(prompt=ours, negative_prompt=None))
    with torch.inference_mode():
        reference = CompelForSD(build_preset("tiny").as_pipeline())(theirs, negative_prompt="")
    torch.testing.assert_close(ours.hidden, reference.embeds)
    torch.testing.assert_close(negative.hidden, reference.negative_embeds)


@pytest.mark.parametrize("preset", ["sdxl-tiny", "sd3-tiny"])
def test_other_families_encode_a_long_prompt_without_a_negative_prompt(preset):
    """SDXL conditions an absent negative prompt on zeros; SD3 on the empty prompt's windows."""
    engine = _engine(preset)
    ours, negative = engine.prompts.encode(_params(prompt=LONG, negative_prompt=None))
    _, empty = engine.prompts.encode(_params(prompt=LONG, negative_prompt=""))
    assert negative.hidden.shape == ours.hidden.shape
    if preset == "sdxl-tiny":
        assert not negative.hidden.any()
    else:
        torch.testing.assert_close(negative.hidden, empty.hidden)


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny", "sd3-tiny"])
@pytest.mark.parametrize("prompt", PLAIN_PROMPTS, ids=PLAIN_IDS)
def test_a_prompt_without_emphasis_within_the_window_encodes_as_diffusers_does(preset, prompt):
    """The text the markup leaves (an escaped bracket: the bracket), encoded as the family's pipeline encodes it."""
    engine = _engine(preset)
    text = prompt.replace("\\", "")
    pipe = build_preset(preset).as_pipeline()
    ours, negative = engine.prompts.encode(_params(prompt=prompt))
    others = {"prompt_2": None, "prompt_3": None} if preset == "sd3-tiny" else {}  # SD3's has no defaults for them
    with torch.inference_mode():
        expected = pipe.encode_prompt(prompt=text, negative_prompt="a blue square", device=CPU, num_images_per_prompt=1,
                                      do_classifier_free_guidance=True, **others)
    assert torch.equal(ours.hidden, expected[0]) and torch.equal(negative.hidden, expected[1])
    assert ours.hidden.shape[1] == engine.prompts.usual_length


@pytest.mark.parametrize("prompt", PLAIN_PROMPTS, ids=PLAIN_IDS)
def test_a_flux_prompt_without_emphasis_encodes_as_diffusers_does(prompt):
    engine = _engine("flux-tiny")
    ours, _ = engine.prompts.encode(_params(prompt=prompt, negative_prompt=None, true_cfg=True))
    with torch.inference_mode():
        expected = build_preset("flux-tiny").as_pipeline().encode_prompt(
            prompt=prompt.replace("\\", ""), prompt_2=None, device=CPU, num_images_per_prompt=1)
    assert torch.equal(ours.hidden, expected[0]) and torch.equal(ours.added["pooled_projections"], expected[1])


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny"])
def test_plain_syntax_takes_brackets_as_text(preset):
    engine = _engine(preset)
    weighted, _ = engine.prompts.encode(_params(prompt="a (red circle:1.3)"))
    plain, _ = engine.prompts.encode(_params(prompt="a (red circle:1.3)", prompt_syntax="plain"))
    unweighted, _ = engine.prompts.encode(_params(prompt="a red circle"))
    assert not torch.allclose(weighted.hidden, plain.hidden)
    assert not torch.allclose(plain.hidden, unweighted.hidden)  # the brackets and the number are tokens
    assert plain.hidden.shape == weighted.hidden.shape


def test_sd3_puts_its_clip_windows_before_its_t5_window():
    engine = _engine("sd3-tiny")
    long, negative = engine.prompts.encode(_params(prompt=LONG))
    short, _ = engine.prompts.encode(_params(prompt="a red circle on a white background"))
    clip_window, t5_window = 77, engine.prompts.max_sequence_length
    assert long.hidden.shape[1] == 2 * clip_window + t5_window and negative.hidden.shape == long.hidden.shape
    assert short.hidden.shape[1] == engine.prompts.usual_length == clip_window + t5_window


def test_a_text_encoder_lora_applies_to_every_window(tmp_path):
    """compel calls the encoder once per window: the request's LoRA must be on for each call."""
    engine = _engine("tiny")
    lora = loaded_lora(engine, write_lora(tmp_path / "te.safetensors", seed=5, text_encoder=True, preset="tiny"))
    weights = lora.load.result()
    params = _params(prompt=LONG)
    without, _ = engine.prompts.encode(params)
    with_lora, _ = engine.prompts.encode(params, [(weights, 1.0)])
    windows = with_lora.hidden.shape[1] // 77
    assert windows == 2
    for window in range(windows):
        part = slice(window * 77, (window + 1) * 77)
        assert (with_lora.hidden[:, part] - without.hidden[:, part]).abs().max() > 1e-4


def test_requests_of_different_text_lengths_run_in_separate_forwards_and_equal_each_alone():
    engine = _engine("tiny")
    requests = [_params(seed=1), _params(seed=2, prompt=LONG)]
    loop = EngineLoop(engine, EngineConfig(max_batch_rows=8))
    try:
        together = [future.result(timeout=120) for future in [loop.submit(params) for params in requests]]
    finally:
        loop.stop()
    for params, result in zip(requests, together, strict=True):
        alone = denoise_together(_engine("tiny"), [(params, [])])[0]
        assert np.abs(_pixels(result.images[0]) - alone[0]).max() <= 2 / 255  # PNG rounding
    assert engine.start(requests[1]).batch_key == (64, 64, 154)
    assert engine.start(requests[0]).batch_key == (64, 64)


def _pixels(png: bytes) -> np.ndarray:
    return decode_png(png).astype(np.float32) / 255
