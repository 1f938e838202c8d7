"""Two seeded ControlNets of a transformer family (SD3, Flux) served in-process, and the family's diffusers ControlNet
pipeline on the same request, for the tests that compare the two."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from PIL import Image

from serving.controlnet.client import LocalControlNets
from serving.controlnet.models import build_controlnet_preset
from serving.controlnet.runner import ControlNetRunner
from serving.engine import GenerationParams
from serving.engine.types import ControlNetSpec
from serving.presets import build_preset
from tests.helpers.denoising import pipeline_images
from tests.helpers.images import shape_image

#: name -> (seed, conditioning image's shape, scale)
_CONTROLNETS = {"edges": (1, "square", 0.8), "mask": (2, "disk", 1.2)}


def seeded_controlnets(preset: str, configure: Callable[[torch.nn.Module], object] = lambda model: None,
                       ) -> dict[str, torch.nn.Module]:
    """``edges`` and ``mask``: ``preset``'s ControlNet with two seeds, each passed to ``configure``."""
    controlnets = {name: build_controlnet_preset(preset, seed=seed) for name, (seed, _, _) in _CONTROLNETS.items()}
    for model in controlnets.values():
        configure(model)
    return controlnets


def local_services(controlnets: dict[str, torch.nn.Module]) -> LocalControlNets:
    return LocalControlNets({name: ControlNetRunner(model, torch.device("cpu")) for name, model in controlnets.items()})


def control_specs(names: Sequence[str]) -> tuple[ControlNetSpec, ...]:
    """The named ControlNets, each with its conditioning image and scale."""
    return tuple(ControlNetSpec(name, shape_image(_CONTROLNETS[name][1]), _CONTROLNETS[name][2]) for name in names)


def reference_images(preset: str, controlnets: dict[str, torch.nn.Module], params: GenerationParams,
                     monkeypatch: pytest.MonkeyPatch, **extra) -> np.ndarray:
    """``params`` (with ``control_specs``) through the family's diffusers ControlNet pipeline. diffusers samples the
    control image's latent distribution with the global generator; the engine takes its mode (one image conditions
    every row alike): the pipeline runs on the mode too."""
    monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mode())
    specs = params.controlnets
    pipe = build_preset(preset).as_controlnet_pipeline([controlnets[spec.name] for spec in specs])
    control = [Image.fromarray(spec.image) for spec in specs]
    scales = [spec.scale for spec in specs]
    return pipeline_images(pipe, params, control_image=control if len(specs) > 1 else control[0],
                           controlnet_conditioning_scale=scales if len(specs) > 1 else scales[0], **extra)
