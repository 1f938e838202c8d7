"""Wire schema of the OpenAI-compatible Images API, and its conversion to engine types.

Field names and shapes follow OpenAI's ``POST /v1/images/generations`` so the official ``openai``
client works; swiftserve's extensions (``negative_prompt``, ``num_inference_steps``,
``guidance_scale``, ``seed``) travel in the same body (``extra_body`` in the client).
"""

from __future__ import annotations

import base64
import re
import secrets
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, ImageLimits, LoRAMode
from serving.controlnet.conditioning import ConditioningImageError, decode_image, preprocess
from serving.engine import GenerationParams, GenerationResult, LoRASpec, ModelInfo
from serving.engine.types import ControlNetSpec

_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
MAX_SEED = 2**63 - 1
#: Request models take JSON types as the schema states them: no `true` for 1, no `"2"` for 2.
_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True)


class LoRARequest(BaseModel):
    """A LoRA to apply: a name from GET /v1/models (kind `lora`) and its strength."""

    model_config = _REQUEST_CONFIG

    name: str = Field(..., min_length=1, max_length=256, description="LoRA file stem in the LoRA directory.")
    scale: float = Field(1.0, allow_inf_nan=False, description="Strength; 0 disables, negative inverts.")


class ControlNetRequest(BaseModel):
    """A ControlNet to condition on: a name from GET /v1/models (kind `controlnet`) and its image."""

    model_config = _REQUEST_CONFIG

    name: str = Field(..., min_length=1, max_length=256, description="ControlNet name.")
    image: str = Field(..., min_length=1, description="Base64 PNG or JPEG (a data: URL works); resized to `size`.")
    conditioning_scale: float = Field(1.0, allow_inf_nan=False, description="Residual multiplier.")
    preprocess: Literal["canny"] | None = Field(None, description="Detector applied to `image` first.")


class ImageGenerationRequest(BaseModel):
    """Body of ``POST /v1/images/generations``. Unknown fields and values of another JSON type are refused,
    naming the field."""

    model_config = _REQUEST_CONFIG | ConfigDict(
        json_schema_extra={"examples": [{"prompt": "a red circle on a white background", "n": 1, "seed": 7}]})

    prompt: str = Field(..., min_length=1, description="What to draw.")
    model: str | None = Field(None, description="Model id from GET /v1/models; default: the served model.")
    n: int = Field(1, ge=1, description="Number of images.")
    size: str | None = Field(None, description="`WIDTHxHEIGHT` in pixels; default: the model's native size.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Only base64 PNG is returned.")
    user: str | None = Field(None, description="Accepted for OpenAI compatibility; unused.")
    negative_prompt: str | None = Field(None, description="What not to draw (unconditional branch of CFG).")
    num_inference_steps: int | None = Field(None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(None, ge=0.0, description="Classifier-free guidance scale.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Image i uses seed + i; random if absent.")
    loras: list[LoRARequest] = Field(default_factory=list, description="LoRAs applied to this request only.")
    lora_mode: LoRAMode | None = Field(
        None, description="`async`: a LoRA not in memory loads while denoising starts without it, applied from the "
                          "first step after the load; `exact`: wait for the LoRAs before the first step, so the image "
                          "is the same whether or not they were cached. Default: the server's (`async` unless "
                          "configured).")
    controlnets: list[ControlNetRequest] = Field(default_factory=list, description="Spatial conditioning.")

    def to_params(self, info: ModelInfo, config: DiffusionAppConfig) -> GenerationParams:
        """Apply the model's defaults and limits (the model already picked by ``model``); raise ``APIError``
        (400) naming the field at fault."""
        limits, defaults = config.limits, config.defaults
        _check_text("prompt", self.prompt, limits.max_prompt_chars)
        if self.negative_prompt is not None:
            _check_text("negative_prompt", self.negative_prompt, limits.max_prompt_chars)
        if self.n > limits.max_n:
            raise _invalid("n", f"at most {limits.max_n} images per request")
        width, height = _parse_size(self.size, info, limits.max_side)
        steps = self.num_inference_steps or defaults.num_inference_steps
        if steps > limits.max_steps:
            raise _invalid("num_inference_steps", f"at most {limits.max_steps} steps")
        guidance = defaults.guidance_scale if self.guidance_scale is None else self.guidance_scale
        if guidance > limits.max_guidance_scale:
            raise _invalid("guidance_scale", f"at most {limits.max_guidance_scale}")
        loras = _check_loras(self.loras, limits.max_loras, limits.max_lora_scale)
        controlnets = _decode_controlnets(self.controlnets, limits)
        seed = secrets.randbelow(2**31) if self.seed is None else self.seed
        if seed + self.n - 1 > MAX_SEED:
            raise _invalid("seed", f"seed + n - 1 must not exceed {MAX_SEED}")
        return GenerationParams(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            n=self.n,
            width=width,
            height=height,
            num_inference_steps=steps,
            guidance_scale=guidance,
            seed=seed,
            loras=loras,
            controlnets=controlnets,
            lora_mode=self.lora_mode or defaults.lora_mode,
        )


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _check_text(param: str, text: str, max_chars: int) -> None:
    if len(text) > max_chars:
        raise _invalid(param, f"longer than {max_chars} characters")


def _check_loras(loras: list[LoRARequest], max_loras: int, max_scale: float) -> tuple[LoRASpec, ...]:
    if len(loras) > max_loras:
        raise _invalid("loras", f"at most {max_loras} LoRAs per request")
    seen: set[str] = set()
    for index, lora in enumerate(loras):
        if lora.name in seen:
            raise _invalid(f"loras[{index}].name", f"LoRA {lora.name!r} is listed twice")
        seen.add(lora.name)
        if abs(lora.scale) > max_scale:
            raise _invalid(f"loras[{index}].scale", f"absolute scale at most {max_scale}")
    return tuple(LoRASpec(lora.name, lora.scale) for lora in loras)


def _decode_controlnets(requests: list[ControlNetRequest], limits: ImageLimits) -> tuple[ControlNetSpec, ...]:
    if len(requests) > limits.max_controlnets:
        raise _invalid("controlnets", f"at most {limits.max_controlnets} ControlNets per request")
    specs = []
    for index, request in enumerate(requests):
        if abs(request.conditioning_scale) > limits.max_conditioning_scale:
            raise _invalid(f"controlnets[{index}].conditioning_scale",
                           f"absolute value at most {limits.max_conditioning_scale}")
        try:
            image = decode_image(request.image, max_bytes=limits.max_image_bytes, max_pixels=limits.max_image_pixels,
                                 max_side=limits.max_image_side)
        except ConditioningImageError as exc:
            raise _invalid(f"controlnets[{index}].image", str(exc)) from None
        specs.append(ControlNetSpec(request.name, preprocess(image, request.preprocess), request.conditioning_scale))
    return tuple(specs)


def _parse_size(size: str | None, info: ModelInfo, max_side: int) -> tuple[int, int]:
    if size is None:
        return info.default_size, info.default_size
    match = _SIZE.match(size)
    if match is None:
        raise _invalid("size", f"expected WIDTHxHEIGHT such as '{info.default_size}x{info.default_size}'")
    width, height = int(match.group(1)), int(match.group(2))
    if max(width, height) > max_side:
        raise _invalid("size", f"width and height must be at most {max_side}")
    if width % info.size_multiple or height % info.size_multiple:
        raise _invalid("size", f"width and height must be multiples of {info.size_multiple}")
    return width, height


class ImageData(BaseModel):
    b64_json: str


class LoRAUsage(BaseModel):
    """How the request's LoRAs were served."""

    names: list[str]
    mode: LoRAMode = Field(description="How the LoRAs were waited for: `async` or `exact` (see the request field).")
    cache_hits: int = Field(description="LoRAs already in host memory when the request arrived.")
    applied_at_step: int | None = Field(description="First denoising step that ran with the LoRAs (0 = all).")
    wait_s: float = Field(description="Seconds the request stood still waiting for a LoRA load.")


class ImageGenerationResponse(BaseModel):
    """OpenAI's images response, plus the seed used, server-side timings (seconds) and LoRA usage."""

    created: int
    data: list[ImageData]
    seed: int
    timings: dict[str, float]
    lora: LoRAUsage | None = None

    @classmethod
    def from_result(cls, result: GenerationResult, total_s: float) -> ImageGenerationResponse:
        return cls(
            created=int(time.time()),
            data=[ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in result.images],
            seed=result.seed,
            timings={**result.timings, "total_s": total_s},
            lora=None if result.lora is None else LoRAUsage(
                names=list(result.lora.names),
                mode=result.lora.mode,
                cache_hits=result.lora.cache_hits,
                applied_at_step=result.lora.applied_at_step,
                wait_s=result.lora.wait_s,
            ),
        )


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models`` (OpenAI shape plus ``kind``); a base model's card gives its family and native
    size, a LoRA's or ControlNet's the base model it is served with."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str
    kind: Literal["base-model", "controlnet", "lora"]
    family: str | None = Field(None, description="Base models: the model family (`sd`, `sdxl`).")
    size: str | None = Field(None, description="Base models: the native `WIDTHxHEIGHT`.")
    model: str | None = Field(None, description="LoRAs and ControlNets: the base model they apply to.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorBody
