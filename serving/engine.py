"""The diffusion engine: engine-level request types and the component that turns them into images.

The HTTP layer converts wire requests (``serving.protocol``) into ``GenerationParams`` and talks to
an ``ImageGenerationBackend``; it never touches models. ``DiffusionEngine`` runs the denoising on
the components of one model; ``LocalBackend`` serves it in-process (a Serve replica or a test).
"""

from __future__ import annotations

import asyncio
import io
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from PIL import Image

from serving.common.device import placement, resolve_device
from serving.common.logging import get_logger
from serving.config import DiffusionModelConfig
from serving.presets import DiffusionComponents, build_preset, load_local

logger = get_logger("engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class GenerationParams:
    """One validated text-to-image request, in engine terms."""

    prompt: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    n: int = 1
    negative_prompt: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    """PNG-encoded images (image ``i`` drawn from seed ``seed + i``) and where the time went."""

    images: list[bytes]
    seed: int
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to validate requests for a model without loading it."""

    name: str
    default_size: int
    size_multiple: int


class ImageGenerationBackend(Protocol):
    """The engine interface the HTTP API talks to."""

    async def model_info(self) -> ModelInfo: ...

    async def generate(self, params: GenerationParams) -> GenerationResult: ...


def load_components(config: DiffusionModelConfig) -> DiffusionComponents:
    """Build a preset or load a local directory, as ``config`` says."""
    if config.preset is not None:
        return build_preset(config.preset, seed=config.seed)
    assert config.path is not None
    return load_local(config.path)


def encode_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class DiffusionEngine:
    """Generates images with one model's components on one device. Not re-entrant: callers serialise."""

    def __init__(self, name: str, components: DiffusionComponents, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.info = ModelInfo(name=name, default_size=components.default_size,
                              size_multiple=components.size_multiple)
        self.device = device
        self._pipeline = components.as_pipeline().to(device)
        if dtype != torch.float32:
            self._pipeline.to(dtype=dtype)
        self._pipeline.set_progress_bar_config(disable=True)

    @classmethod
    def from_config(cls, config: DiffusionModelConfig) -> DiffusionEngine:
        device = resolve_device(config.device)
        started = time.perf_counter()
        engine = cls(config.name, load_components(config), device, _DTYPES[config.dtype])
        source = f"preset={config.preset}" if config.preset else f"path={config.path}"
        logger.info("diffusion model %r loaded (%s, device=%s, dtype=%s) in %.1fs on %s",
                    config.name, source, device, config.dtype, time.perf_counter() - started, placement())
        return engine

    def validate(self, params: GenerationParams) -> None:
        multiple = self.info.size_multiple
        if params.width % multiple or params.height % multiple:
            raise ValueError(f"width and height must be multiples of {multiple}")

    @torch.inference_mode()
    def generate(self, params: GenerationParams) -> GenerationResult:
        self.validate(params)
        started = time.perf_counter()
        generators = [torch.Generator(self.device).manual_seed(params.seed + i) for i in range(params.n)]
        output = self._pipeline(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            num_images_per_prompt=params.n,
            width=params.width,
            height=params.height,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            generator=generators,
            output_type="pil",
        )
        denoised = time.perf_counter()
        images = [encode_png(image) for image in output.images]
        return GenerationResult(
            images=images,
            seed=params.seed,
            timings={"inference_s": denoised - started, "encode_s": time.perf_counter() - denoised},
        )


class LocalBackend:
    """Serves a ``DiffusionEngine`` in this process: one generation at a time, off the event loop."""

    def __init__(self, engine: DiffusionEngine) -> None:
        self._engine = engine
        self._lock = asyncio.Lock()

    async def model_info(self) -> ModelInfo:
        return self._engine.info

    async def generate(self, params: GenerationParams) -> GenerationResult:
        queued = time.perf_counter()
        async with self._lock:
            waited = time.perf_counter() - queued
            result = await asyncio.to_thread(self._engine.generate, params)
        return GenerationResult(result.images, result.seed, {"queue_s": waited, **result.timings})
