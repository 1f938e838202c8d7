"""LoRA storage: names -> files (registry), files -> validated unmerged weights (format), a host LRU (cache).

Names are imported on first use, so importing the package loads no model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.common.lazy import lazy_exports

if TYPE_CHECKING:
    from serving.lora.cache import LoRACache
    from serving.lora.format import LoRAFormatError, LoRATargets, ModuleShape, load_lora_file
    from serving.lora.registry import InvalidLoRAName, LoRANotFound, LoRARegistry
    from serving.lora.weights import LoRALayer, LoRAWeights

_EXPORTS = {
    "LoRACache": "serving.lora.cache",
    "LoRAFormatError": "serving.lora.format",
    "LoRATargets": "serving.lora.format",
    "ModuleShape": "serving.lora.format",
    "load_lora_file": "serving.lora.format",
    "InvalidLoRAName": "serving.lora.registry",
    "LoRANotFound": "serving.lora.registry",
    "LoRARegistry": "serving.lora.registry",
    "LoRALayer": "serving.lora.weights",
    "LoRAWeights": "serving.lora.weights",
}
__all__ = [
    "InvalidLoRAName",
    "LoRACache",
    "LoRAFormatError",
    "LoRALayer",
    "LoRANotFound",
    "LoRARegistry",
    "LoRATargets",
    "LoRAWeights",
    "ModuleShape",
    "load_lora_file",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
