"""The built-in diffusion presets by name and the trained weights shipped for them.

Standard library only, so configs validate preset names without loading torch; ``serving.presets`` builds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

#: Each preset's model family (``serving.presets.ModelFamily``).
PRESET_FAMILIES: dict[str, str] = {"tiny": "sd", "sd15-shape": "sd", "sdxl-tiny": "sdxl", "sdxl-shape": "sdxl",
                                   "sd3-tiny": "sd3", "flux-tiny": "flux", "flux-schnell-tiny": "flux"}
PRESET_NAMES: tuple[str, ...] = tuple(PRESET_FAMILIES)
#: Trained weights shipped in the repository, one diffusers pipeline directory per preset that has them
#: (written by ``python -m training.tiny_diffusion``); its ``controlnet/`` and ``loras/`` hold the extras.
WEIGHTS_ROOT = Path(__file__).resolve().parent / "weights"
WeightsChoice = Literal["auto", "seeded"]
WEIGHTS_CHOICES: tuple[str, ...] = get_args(WeightsChoice)


def check_preset(name: str) -> None:
    """ValueError naming the known presets unless ``name`` is one."""
    if name not in PRESET_NAMES:
        raise ValueError(f"unknown diffusion preset {name!r}; known presets: {', '.join(PRESET_NAMES)}")


def preset_weights(name: str) -> Path | None:
    """The shipped trained pipeline directory of preset ``name``, or None when it has none. Only a known preset
    name is joined to ``WEIGHTS_ROOT`` (never ``..`` or an absolute path)."""
    check_preset(name)
    directory = WEIGHTS_ROOT / name
    return directory if (directory / "model_index.json").is_file() else None
