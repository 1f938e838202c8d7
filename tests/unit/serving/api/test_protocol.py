import base64

import numpy as np
import pytest
from pydantic import ValidationError

from serving.api.protocol import MAX_SEED, ImageEditRequest, ImageGenerationRequest
from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, GenerationDefaults, ImageLimits
from serving.engine import ModelInfo
from tests.helpers.images import encode_b64

INFO = ModelInfo(name="tiny", default_size=64, size_multiple=8)
CONFIG = DiffusionAppConfig(
    defaults=GenerationDefaults(num_inference_steps=4, guidance_scale=5.0),
    limits=ImageLimits(max_n=2, max_steps=10, max_side=256, max_prompt_chars=50),
)


def _params(**body):
    return ImageGenerationRequest.model_validate({"prompt": "a red circle", **body}).to_params(INFO, CONFIG)


def test_defaults_come_from_model_and_config():
    params = _params(seed=5)
    assert (params.width, params.height) == (64, 64)
    assert (params.num_inference_steps, params.guidance_scale) == (4, 5.0)
    assert (params.seed, params.n, params.negative_prompt) == (5, 1, None)


def test_lora_mode_comes_from_the_request_else_the_config_default():
    assert _params().lora_mode == "async"
    assert _params(lora_mode="exact").lora_mode == "exact"
    exact_by_default = CONFIG.model_copy(update={"defaults": CONFIG.defaults.model_copy(update={"lora_mode": "exact"})})
    request = ImageGenerationRequest.model_validate({"prompt": "a red circle"})
    assert request.to_params(INFO, exact_by_default).lora_mode == "exact"
    assert _params(lora_mode="async").lora_mode == "async"


def test_explicit_fields_are_used():
    params = _params(size="128x64", n=2, num_inference_steps=3, guidance_scale=0.0, seed=9,
                     negative_prompt="blue", model="tiny")
    assert (params.width, params.height, params.n, params.num_inference_steps) == (128, 64, 2, 3)
    assert (params.guidance_scale, params.seed, params.negative_prompt) == (0.0, 9, "blue")


def test_prompts_are_read_as_weighted_unless_the_request_says_plain():
    assert _params().prompt_syntax == "weighted"
    plain = _params(prompt="a (cat:11)", prompt_syntax="plain")  # a weight the weighted syntax refuses is text
    assert (plain.prompt, plain.prompt_syntax) == ("a (cat:11)", "plain")


def test_missing_seed_is_drawn_per_request():
    seeds = {_params().seed for _ in range(8)}
    assert len(seeds) > 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 3}, "n"),
        ({"size": "64"}, "size"),
        ({"size": "64x64x3"}, "size"),
        ({"size": "512x64"}, "size"),
        ({"size": "60x64"}, "size"),
        ({"num_inference_steps": 11}, "num_inference_steps"),
        ({"guidance_scale": 31}, "guidance_scale"),
        ({"prompt": "x" * 51}, "prompt"),
        ({"negative_prompt": "x" * 51}, "negative_prompt"),
        ({"seed": MAX_SEED, "n": 2}, "seed"),
        ({"prompt": "a (cat:11)"}, "prompt"),
        ({"negative_prompt": "(blue:-1)"}, "negative_prompt"),
    ],
)
def test_limits_name_the_field(body, param):
    with pytest.raises(APIError) as caught:
        _params(**body)
    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert caught.value.message.startswith(param)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": "two"}, "n"),
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "output_format": "jpeg"}, "output_format"),
        ({"prompt": "x", "quality": "high"}, "quality"),
        ({"prompt": "x", "background": "transparent"}, "background"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "guidence_scale": 3}, "guidence_scale"),
        ({"prompt": "x", "prompt_syntax": "compel"}, "prompt_syntax"),
    ],
)
def test_schema_violations_point_at_the_field(body, field):
    with pytest.raises(ValidationError) as caught:
        ImageGenerationRequest.model_validate(body)
    assert caught.value.errors()[0]["loc"][0] == field


def test_the_configured_image_side_limit_applies_to_conditioning_images():
    image = encode_b64(np.zeros((8, 300, 3), dtype=np.uint8))  # 2,400 pixels: far inside the pixel cap
    body = {"controlnets": [{"name": "edges", "image": image}]}
    strict = CONFIG.model_copy(update={"limits": CONFIG.limits.model_copy(update={"max_image_side": 256})})
    with pytest.raises(APIError) as refused:
        ImageGenerationRequest.model_validate({"prompt": "a red circle", **body}).to_params(INFO, strict)
    assert refused.value.status_code == 400 and refused.value.param == "controlnets[0].image"
    assert "256" in refused.value.message
    assert _params(**body).controlnets[0].image.shape[:2] == (8, 300)  # the default side cap (8192) admits it


# --- streaming, schedulers and edits --------------------------------------------------------------------------

SCHEDULED = ModelInfo(name="tiny", default_size=64, size_multiple=8, schedulers=("ddim", "euler"),
                      default_scheduler="pndm")


def test_partial_images_go_to_the_engine_only_with_stream():
    assert _params(stream=True, partial_images=3).partial_images == 3
    assert _params(stream=True).partial_images == _params(partial_images=0).partial_images == 0
    with pytest.raises(APIError) as refused:
        _params(partial_images=1)
    assert (refused.value.status_code, refused.value.param) == (400, "partial_images")
    assert "`stream: true`" in refused.value.message


@pytest.mark.parametrize("partial_images", [-1, 4, True, "2"])
def test_partial_images_outside_0_to_3_are_refused_by_the_schema(partial_images):
    with pytest.raises(ValidationError) as caught:
        ImageGenerationRequest.model_validate({"prompt": "x", "stream": True, "partial_images": partial_images})
    assert caught.value.errors()[0]["loc"] == ("partial_images",)


def _scheduled(scheduler: str | None, info: ModelInfo = SCHEDULED) -> str | None:
    return ImageGenerationRequest.model_validate({"prompt": "x", "scheduler": scheduler}).to_params(
        info, CONFIG).scheduler


def test_a_scheduler_is_one_of_the_models_and_its_own_is_the_default():
    assert [_scheduled(name) for name in (None, "pndm", "ddim", "euler")] == [None, None, "ddim", "euler"]


@pytest.mark.parametrize(("info", "choices"), [(SCHEDULED, "pndm, ddim, euler"), (INFO, "none")])
def test_an_unknown_scheduler_is_400_listing_the_choices(info, choices):
    with pytest.raises(APIError) as refused:
        _scheduled("karras", info)
    assert refused.value.param == "scheduler"
    assert refused.value.message == f"scheduler: unknown scheduler 'karras'; choices: {choices}"


def _png(image: np.ndarray) -> bytes:
    return base64.b64decode(encode_b64(image))


def _edit(image: np.ndarray, mask: np.ndarray | None = None, **body):
    request = ImageEditRequest.model_validate({"prompt": "a red circle", **body})
    return request.to_params(INFO, CONFIG, _png(image), None if mask is None else _png(mask))


def test_an_edit_shares_the_generation_fields_and_their_limits():
    assert set(ImageGenerationRequest.model_fields) - set(ImageEditRequest.model_fields) == {"controlnets"}
    assert set(ImageEditRequest.model_fields) - set(ImageGenerationRequest.model_fields) == {"strength"}
    with pytest.raises(APIError) as refused:
        _edit(np.zeros((16, 16, 3), np.uint8), n=3)
    assert refused.value.param == "n"


def test_an_edits_strength_defaults_as_diffusers_and_to_the_config():
    image, mask = np.zeros((16, 24, 3), np.uint8), np.full((16, 24), 255, np.uint8)
    assert (_edit(image).edit.strength, _edit(image, mask).edit.strength) == (0.8, 1.0)
    assert _edit(image, mask, strength=0.3).edit.strength == 0.3
    configured = CONFIG.model_copy(update={"defaults": CONFIG.defaults.model_copy(update={"edit_strength": 0.6})})
    request = ImageEditRequest.model_validate({"prompt": "x"})
    assert request.to_params(INFO, configured, _png(image), None).edit.strength == 0.6


@pytest.mark.parametrize("strength", [0, -0.5, 1.01, float("nan"), "0.5"])
def test_strength_outside_0_to_1_is_refused_by_the_schema(strength):
    with pytest.raises(ValidationError) as caught:
        ImageEditRequest.model_validate({"prompt": "x", "strength": strength})
    assert caught.value.errors()[0]["loc"] == ("strength",)


def test_an_edit_at_the_images_size_keeps_its_pixels_and_a_mask_without_alpha_is_white_to_repaint():
    image = np.arange(16 * 24 * 3, dtype=np.uint8).reshape(16, 24, 3)
    mask = np.zeros((16, 24), np.uint8)
    mask[4:8, 8:16] = 200
    params = _edit(image, mask)
    assert (params.width, params.height) == (24, 16)
    np.testing.assert_array_equal(params.edit.image, image)
    np.testing.assert_array_equal(params.edit.mask, np.where(mask > 0, 255, 0))


def test_openais_auto_size_and_png_output_are_the_defaults():
    params = _params(size="auto", output_format="png", quality="auto", background="opaque")
    assert (params.width, params.height) == (INFO.default_size, INFO.default_size)
    image = np.zeros((16, 24, 3), np.uint8)
    assert (_edit(image, size="auto").width, _edit(image, size="auto").height) == (24, 16)
