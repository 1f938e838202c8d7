"""The diffusion engine: request types, denoising primitives, the batching loop, the local backend."""

from serving.engine.admission import EngineOverloaded
from serving.engine.backend import LocalBackend
from serving.engine.diffusion_engine import DiffusionEngine, encode_png, load_components
from serving.engine.loop import EngineLoop, LoRALoadFailed
from serving.engine.request import RequestState
from serving.engine.types import (
    EditImage,
    GenerationEvent,
    GenerationParams,
    GenerationResult,
    ImageGenerationBackend,
    LoRAReport,
    LoRASpec,
    ModelInfo,
    PartialImage,
)

__all__ = [
    "DiffusionEngine",
    "EditImage",
    "EngineLoop",
    "EngineOverloaded",
    "GenerationEvent",
    "GenerationParams",
    "GenerationResult",
    "ImageGenerationBackend",
    "LoRALoadFailed",
    "LoRAReport",
    "LoRASpec",
    "LocalBackend",
    "ModelInfo",
    "PartialImage",
    "RequestState",
    "encode_png",
    "load_components",
]
