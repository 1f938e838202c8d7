"""Disaggregated DLRM serving (DESIGN.md §4): model, OIP v2 API, monolithic baseline.

Names are imported on first use, so ``import disagg`` loads neither torch nor Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.common.lazy import lazy_exports

if TYPE_CHECKING:
    from disagg.app import build_app
    from disagg.config import BatchingConfig, DLRMAppConfig, DLRMLimits, DLRMModelConfig
    from disagg.model import DLRM, PRESETS, DLRMSpec, build_preset, preset_spec

_EXPORTS = {
    "BatchingConfig": "disagg.config",
    "DLRMAppConfig": "disagg.config",
    "DLRMLimits": "disagg.config",
    "DLRMModelConfig": "disagg.config",
    "DLRM": "disagg.model",
    "DLRMSpec": "disagg.model",
    "PRESETS": "disagg.model",
    "build_preset": "disagg.model",
    "preset_spec": "disagg.model",
    "build_app": "disagg.app",
}

__all__ = [
    "DLRM",
    "PRESETS",
    "BatchingConfig",
    "DLRMAppConfig",
    "DLRMLimits",
    "DLRMModelConfig",
    "DLRMSpec",
    "build_app",
    "build_preset",
    "preset_spec",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)
