"""Diffusion serving on Ray Serve: OpenAI Images API over a diffusers-based engine.

Public surface: configs, the Serve app builder, model presets and the engine interface. Names are
imported on first use, so ``import serving.common`` (used by every package) loads no model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.common.lazy import lazy_exports

if TYPE_CHECKING:
    from serving.app import build_app
    from serving.config import DiffusionAppConfig, DiffusionModelConfig, GenerationDefaults, ImageLimits
    from serving.engine import DiffusionEngine, GenerationParams, GenerationResult, ImageGenerationBackend
    from serving.preset_catalog import PRESET_NAMES
    from serving.presets import DiffusionComponents, build_preset, load_local

_EXPORTS = {
    "build_app": "serving.app",
    "DiffusionAppConfig": "serving.config",
    "DiffusionModelConfig": "serving.config",
    "GenerationDefaults": "serving.config",
    "ImageLimits": "serving.config",
    "DiffusionEngine": "serving.engine",
    "GenerationParams": "serving.engine",
    "GenerationResult": "serving.engine",
    "ImageGenerationBackend": "serving.engine",
    "PRESET_NAMES": "serving.preset_catalog",
    "DiffusionComponents": "serving.presets",
    "build_preset": "serving.presets",
    "load_local": "serving.presets",
}
__all__ = [
    "PRESET_NAMES",
    "DiffusionAppConfig",
    "DiffusionComponents",
    "DiffusionEngine",
    "DiffusionModelConfig",
    "GenerationDefaults",
    "GenerationParams",
    "GenerationResult",
    "ImageGenerationBackend",
    "ImageLimits",
    "build_app",
    "build_preset",
    "load_local",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
