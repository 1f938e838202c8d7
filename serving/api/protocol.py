"""Wire schema of the OpenAI-compatible Images API, and its conversion to engine types.

Field names and shapes follow OpenAI's ``POST /v1/images/generations`` and ``POST /v1/images/edits``, and their
server-sent events with ``stream: true``, so the official ``openai`` client works; swiftserve's extensions
(``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``seed``, ``scheduler``, ``strength``, ...)
travel in the same body (``extra_body`` in the client).
"""

from __future__ import annotations

import base64
import re
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, ImageLimits, LoRAMode
from serving.controlnet.conditioning import preprocess
from serving.engine import EditImage, GenerationParams, GenerationResult, LoRAReport, LoRASpec, ModelInfo, PartialImage
from serving.engine.emphasis import EmphasisError, PromptSyntax, parse_emphasis
from serving.engine.types import ControlNetSpec
from serving.images import ImageDecodeError, decode_image, decode_image_bytes, decode_mask, resize_image, resize_mask

_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
MAX_SEED = 2**63 - 1
#: OpenAI's ``size`` for "the default": the model's native size, an edit's image's own.
AUTO_SIZE = "auto"
#: Previews a streamed request may ask for per image (OpenAI's ``partial_images``).
MAX_PARTIAL_IMAGES = 3
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


class _ImageRequest(BaseModel):
    """The fields text-to-image and edit requests share, and their validation against a model's limits."""

    model_config = _REQUEST_CONFIG

    prompt: str = Field(..., min_length=1, description="What to draw.")
    model: str | None = Field(None, description="Model id from GET /v1/models; default: the served model.")
    n: int = Field(1, ge=1, description="Number of images.")
    size: str | None = Field(
        None, description="`WIDTHxHEIGHT` in pixels; default (or `auto`): the model's native size.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Only base64 PNG is returned.")
    output_format: Literal["png"] = Field("png", description="Only PNG is returned (OpenAI's field).")
    quality: Literal["auto"] = Field("auto", description="OpenAI's field: only `auto` (steps set the effort).")
    background: Literal["auto", "opaque"] = Field("auto", description="OpenAI's field: images are opaque.")
    user: str | None = Field(None, description="Accepted for OpenAI compatibility; unused.")
    stream: bool = Field(False, description="Answer with server-sent events: previews, then each image.")
    partial_images: int | None = Field(
        None, ge=0, le=MAX_PARTIAL_IMAGES,
        description="With `stream`: previews sent per image while it denoises (approximate latent previews).")
    negative_prompt: str | None = Field(None, description="What not to draw (unconditional branch of CFG).")
    prompt_syntax: PromptSyntax = Field(
        "weighted", description="`weighted`: `(text)`, `[text]` and `(text:1.3)` weigh text as in AUTOMATIC1111 "
                                "(an unpaired bracket is text); `plain`: every character is text. Prompts past the "
                                "text encoder's window are encoded window by window either way.")
    num_inference_steps: int | None = Field(None, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(
        None, ge=0.0, description="Classifier-free guidance scale (Flux [dev]: the scale its guidance embedding "
                                  "takes; [schnell]: unused).")
    true_cfg_scale: float | None = Field(
        None, ge=0.0, description="Flux only: classifier-free guidance at this scale when it exceeds 1 and a "
                                  "`negative_prompt` is given (two denoiser passes per step). Default 1: none.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Image i uses seed + i; random if absent.")
    scheduler: str | None = Field(
        None, min_length=1, description="Noise scheduler, one of the model's `schedulers` (GET /v1/models); "
                                        "default: the model's own.")
    loras: list[LoRARequest] = Field(default_factory=list, description="LoRAs applied to this request only.")
    lora_mode: LoRAMode | None = Field(
        None, description="`async`: a LoRA not in memory loads while denoising starts without it, applied from the "
                          "first step after the load; `exact`: wait for the LoRAs before the first step, so the image "
                          "is the same whether or not they were cached. Default: the server's (`async` unless "
                          "configured).")

    def requested_items(self) -> dict[str, list[str]]:
        """The names the request lists, by field: what ``ServedModels.explain_missing`` looks for."""
        return {"loras": [lora.name for lora in self.loras], "controlnets": []}

    def _common_params(self, info: ModelInfo, config: DiffusionAppConfig) -> dict[str, Any]:
        """The ``GenerationParams`` fields every request has, with the model's defaults and limits applied (the
        model already picked by ``model``); raise ``APIError`` (400) naming the field at fault."""
        limits, defaults = config.limits, config.defaults
        _check_text("prompt", self.prompt, limits.max_prompt_chars, self.prompt_syntax)
        if self.negative_prompt is not None:
            _check_text("negative_prompt", self.negative_prompt, limits.max_prompt_chars, self.prompt_syntax)
        if self.n > limits.max_n:
            raise invalid_field("n", f"at most {limits.max_n} images per request")
        if self.partial_images and not self.stream:
            raise invalid_field("partial_images", "previews are streamed: send `stream: true` with them")
        steps = self.num_inference_steps or defaults.num_inference_steps
        if steps > limits.max_steps:
            raise invalid_field("num_inference_steps", f"at most {limits.max_steps} steps")
        guidance = defaults.guidance_scale if self.guidance_scale is None else self.guidance_scale
        if guidance > limits.max_guidance_scale:
            raise invalid_field("guidance_scale", f"at most {limits.max_guidance_scale}")
        if self.true_cfg_scale is not None and not info.true_cfg:
            raise invalid_field("true_cfg_scale", "this model runs classifier-free guidance at `guidance_scale`; "
                                                  "`true_cfg_scale` is for Flux models")
        true_cfg_scale = 1.0 if self.true_cfg_scale is None else self.true_cfg_scale
        if true_cfg_scale > limits.max_guidance_scale:
            raise invalid_field("true_cfg_scale", f"at most {limits.max_guidance_scale}")
        seed = secrets.randbelow(2**31) if self.seed is None else self.seed
        if seed + self.n - 1 > MAX_SEED:
            raise invalid_field("seed", f"seed + n - 1 must not exceed {MAX_SEED}")
        return {
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "n": self.n,
            "num_inference_steps": steps,
            "guidance_scale": guidance,
            "seed": seed,
            "loras": _check_loras(self.loras, limits.max_loras, limits.max_lora_scale),
            "lora_mode": self.lora_mode or defaults.lora_mode,
            "scheduler": _check_scheduler(self.scheduler, info),
            "partial_images": self.partial_images or 0,
            "prompt_syntax": self.prompt_syntax,
            "true_cfg": info.true_cfg,
            "true_cfg_scale": true_cfg_scale,
        }


class ImageGenerationRequest(_ImageRequest):
    """Body of ``POST /v1/images/generations``. Unknown fields and values of another JSON type are refused,
    naming the field."""

    model_config = _REQUEST_CONFIG | ConfigDict(
        json_schema_extra={"examples": [{"prompt": "a red circle on a white background", "n": 1, "seed": 7}]})

    controlnets: list[ControlNetRequest] = Field(default_factory=list, description="Spatial conditioning.")

    def requested_items(self) -> dict[str, list[str]]:
        return {**super().requested_items(), "controlnets": [controlnet.name for controlnet in self.controlnets]}

    def to_params(self, info: ModelInfo, config: DiffusionAppConfig) -> GenerationParams:
        """Apply the model's defaults and limits (the model already picked by ``model``); raise ``APIError``
        (400) naming the field at fault."""
        common = self._common_params(info, config)
        width, height = _parse_size(self.size, info, config.limits.max_side)
        controlnets = _decode_controlnets(self.controlnets, config.limits)
        return GenerationParams(**common, width=width, height=height, controlnets=controlnets)


class ImageEditRequest(_ImageRequest):
    """The fields of ``POST /v1/images/edits`` besides its files ``image`` and ``mask``: the multipart form's
    values, validated as the JSON route validates its body (``serving.api.edits`` converts them)."""

    size: str | None = Field(
        None, description="`WIDTHxHEIGHT` in pixels, the image resized to it; default (or `auto`): the image's "
                          "size, scaled down to fit `limits.max_side` and rounded down to the model's size multiple.")
    strength: float | None = Field(
        None, gt=0.0, le=1.0,
        description="How far into the noise schedule the edit starts: 1.0 starts from pure noise (keeping only "
                    "what the mask keeps). Default: 0.8 without a mask, 1.0 with one (as diffusers).")

    def to_params(self, info: ModelInfo, config: DiffusionAppConfig, image: bytes,
                  mask: bytes | None) -> GenerationParams:
        """Apply the model's defaults and limits and decode ``image`` and ``mask`` (PNG or JPEG files, the mask of
        the image's size); raise ``APIError`` (400) naming the field at fault."""
        common = self._common_params(info, config)
        limits, defaults = config.limits, config.defaults
        source = _decode("image", decode_image_bytes, image, limits)
        repaint = None if mask is None else _decode("mask", decode_mask, mask, limits)
        if repaint is not None and repaint.shape != source.shape[:2]:
            raise invalid_field("mask", f"mask is {_size_of(repaint)}; it must have the image's size, "
                                        f"{_size_of(source)}")
        width, height = _edit_size(self.size, source, info, limits.max_side)
        if self.strength is not None:
            strength = self.strength
        else:
            strength = defaults.edit_strength if repaint is None else defaults.inpaint_strength
        edit = EditImage(resize_image(source, width, height),
                         None if repaint is None else resize_mask(repaint, width, height), strength)
        return GenerationParams(**common, width=width, height=height, edit=edit)


def invalid_field(param: str, message: str) -> APIError:
    """A 400 naming ``param``, its message starting with it."""
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _check_text(param: str, text: str, max_chars: int, syntax: PromptSyntax) -> None:
    if len(text) > max_chars:
        raise invalid_field(param, f"longer than {max_chars} characters")
    if syntax == "weighted":
        try:
            parse_emphasis(text)
        except EmphasisError as error:
            raise invalid_field(param, f"{error} (or send `prompt_syntax: plain` to take brackets as text)") from None


def _check_loras(loras: list[LoRARequest], max_loras: int, max_scale: float) -> tuple[LoRASpec, ...]:
    if len(loras) > max_loras:
        raise invalid_field("loras", f"at most {max_loras} LoRAs per request")
    seen: set[str] = set()
    for index, lora in enumerate(loras):
        if lora.name in seen:
            raise invalid_field(f"loras[{index}].name", f"LoRA {lora.name!r} is listed twice")
        seen.add(lora.name)
        if abs(lora.scale) > max_scale:
            raise invalid_field(f"loras[{index}].scale", f"absolute scale at most {max_scale}")
    return tuple(LoRASpec(lora.name, lora.scale) for lora in loras)


def _decode_controlnets(requests: list[ControlNetRequest], limits: ImageLimits) -> tuple[ControlNetSpec, ...]:
    if len(requests) > limits.max_controlnets:
        raise invalid_field("controlnets", f"at most {limits.max_controlnets} ControlNets per request")
    specs = []
    for index, request in enumerate(requests):
        if abs(request.conditioning_scale) > limits.max_conditioning_scale:
            raise invalid_field(f"controlnets[{index}].conditioning_scale",
                                f"absolute value at most {limits.max_conditioning_scale}")
        image = _decode(f"controlnets[{index}].image", decode_image, request.image, limits)
        specs.append(ControlNetSpec(request.name, preprocess(image, request.preprocess), request.conditioning_scale))
    return tuple(specs)


def _decode(param: str, decoder: Callable[..., np.ndarray], data: str | bytes, limits: ImageLimits) -> np.ndarray:
    """``decoder(data)`` within the image limits; 400 naming ``param`` when the file cannot be used."""
    try:
        return decoder(data, max_bytes=limits.max_image_bytes, max_pixels=limits.max_image_pixels,
                       max_side=limits.max_image_side)
    except ImageDecodeError as exc:
        raise invalid_field(param, str(exc)) from None


def _size_of(image: np.ndarray) -> str:
    """An image array's size as ``WIDTHxHEIGHT``."""
    return f"{image.shape[1]}x{image.shape[0]}"


def _check_scheduler(name: str | None, info: ModelInfo) -> str | None:
    """The scheduler the engine runs for a request naming ``name``: None for the model's own."""
    if name is None or name == info.default_scheduler:
        return None
    if name not in info.schedulers:
        choices = ", ".join(dict.fromkeys(filter(None, (info.default_scheduler, *info.schedulers)))) or "none"
        raise invalid_field("scheduler", f"unknown scheduler {name!r}; choices: {choices}")
    return name


def _edit_size(size: str | None, image: np.ndarray, info: ModelInfo, max_side: int) -> tuple[int, int]:
    """The requested ``size``, else the image's: scaled down to fit ``max_side``, rounded down to the model's
    size multiple."""
    if size not in (None, AUTO_SIZE):
        return _parse_size(size, info, max_side)
    height, width = image.shape[:2]
    longest, multiple = max(width, height), info.size_multiple
    fitted = [side if longest <= max_side else side * max_side // longest for side in (width, height)]
    if min(fitted) < multiple:
        raise invalid_field("image", f"image is {width}x{height}; without `size` its sides must be at least "
                                     f"{multiple} pixels once scaled to fit {max_side}")
    return fitted[0] // multiple * multiple, fitted[1] // multiple * multiple


def _parse_size(size: str | None, info: ModelInfo, max_side: int) -> tuple[int, int]:
    if size in (None, AUTO_SIZE):
        return info.default_size, info.default_size
    match = _SIZE.match(size)
    if match is None:
        raise invalid_field("size", f"expected WIDTHxHEIGHT such as '{info.default_size}x{info.default_size}'")
    width, height = int(match.group(1)), int(match.group(2))
    if max(width, height) > max_side:
        raise invalid_field("size", f"width and height must be at most {max_side}")
    if width % info.size_multiple or height % info.size_multiple:
        raise invalid_field("size", f"width and height must be multiples of {info.size_multiple}")
    return width, height


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


class ImageData(BaseModel):
    b64_json: str


class LoRAUsage(BaseModel):
    """How the request's LoRAs were served."""

    names: list[str]
    mode: LoRAMode = Field(description="How the LoRAs were waited for: `async` or `exact` (see the request field).")
    cache_hits: int = Field(description="LoRAs already in host memory when the request arrived.")
    applied_at_step: int | None = Field(description="First denoising step that ran with the LoRAs (0 = all).")
    wait_s: float = Field(description="Seconds the request stood still waiting for a LoRA load.")

    @classmethod
    def of(cls, report: LoRAReport | None) -> LoRAUsage | None:
        if report is None:
            return None
        return cls(names=list(report.names), mode=report.mode, cache_hits=report.cache_hits,
                   applied_at_step=report.applied_at_step, wait_s=report.wait_s)


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
            data=[ImageData(b64_json=_b64(png)) for png in result.images],
            seed=result.seed,
            timings={**result.timings, "total_s": total_s},
            lora=LoRAUsage.of(result.lora),
        )


#: The event names of a stream: ``image_generation.*`` for generations, ``image_edit.*`` for edits (OpenAI's).
StreamKind = Literal["image_generation", "image_edit"]


class InputTokensDetails(BaseModel):
    image_tokens: int = 0
    text_tokens: int = 0


class ImageUsage(BaseModel):
    """OpenAI's token usage of GPT image models, which the client's completed events require: zeros here."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    total_tokens: int = 0


class _ImageEvent(BaseModel):
    """The fields of OpenAI's image events, plus ``image_index``: which of the request's ``n`` images it shows."""

    type: str
    b64_json: str
    created_at: int
    size: str
    quality: Literal["auto"] = "auto"
    background: Literal["opaque"] = "opaque"
    output_format: Literal["png"] = "png"
    image_index: int


class PartialImageEvent(_ImageEvent):
    """``<kind>.partial_image``: a preview (an approximate decode of the latents), plus the step it was made at."""

    type: Literal["image_generation.partial_image", "image_edit.partial_image"]
    partial_image_index: int
    step: int

    @classmethod
    def of(cls, partial: PartialImage, kind: StreamKind, size: str) -> PartialImageEvent:
        return cls(type=f"{kind}.partial_image", b64_json=_b64(partial.png), created_at=int(time.time()), size=size,
                   image_index=partial.image_index, partial_image_index=partial.partial_index, step=partial.step)


class ImageCompletedEvent(_ImageEvent):
    """``<kind>.completed``: one final image, plus its seed, the request's timings (seconds) and LoRA usage."""

    type: Literal["image_generation.completed", "image_edit.completed"]
    usage: ImageUsage = ImageUsage()
    seed: int
    timings: dict[str, float]
    lora: LoRAUsage | None = None

    @classmethod
    def of(cls, result: GenerationResult, kind: StreamKind, size: str, total_s: float) -> list[ImageCompletedEvent]:
        """One event per image of ``result``, in order."""
        created, timings, lora = int(time.time()), {**result.timings, "total_s": total_s}, LoRAUsage.of(result.lora)
        return [cls(type=f"{kind}.completed", b64_json=_b64(png), created_at=created, size=size, image_index=index,
                    seed=result.seed + index, timings=timings, lora=lora)
                for index, png in enumerate(result.images)]


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models`` (OpenAI shape plus ``kind``); a base model's card gives its family, native
    size and schedulers, a LoRA's or ControlNet's the base model it is served with."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str
    kind: Literal["base-model", "controlnet", "lora"]
    family: str | None = Field(None, description="Base models: the model family (`sd`, `sdxl`).")
    size: str | None = Field(None, description="Base models: the native `WIDTHxHEIGHT`.")
    schedulers: list[str] | None = Field(None, description="Base models: what a request's `scheduler` may name.")
    default_scheduler: str | None = Field(None, description="Base models: the scheduler used when none is named.")
    model: str | None = Field(None, description="LoRAs and ControlNets: the base model they apply to.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, error: APIError) -> ErrorBody:
        """``error`` as OpenAI describes one; a missing or wrong API key is an ``invalid_request_error``."""
        fallback = "invalid_request_error" if error.status_code < 500 else "server_error"
        kind = _ERROR_TYPES.get(error.status_code, fallback)
        return cls(message=error.message, type=kind, param=error.param, code=error.code)


_ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorBody


class StreamErrorEvent(BaseModel):
    """``error``: what ends a stream that fails after its first event."""

    type: Literal["error"] = "error"
    error: ErrorBody
