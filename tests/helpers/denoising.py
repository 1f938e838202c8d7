"""Driving a ``DiffusionEngine`` directly: requests stepped as one batch from start to end, no engine loop."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.request import PendingLoRA
from serving.lora.format import load_lora_file


def loaded_lora(engine: DiffusionEngine, path: Path, scale: float = 0.8) -> PendingLoRA:
    """The LoRA file at ``path`` as a request's already loaded LoRA (named after the file)."""
    load: Future = Future()
    load.set_result(load_lora_file(path, engine.lora_targets, max_file_bytes=2**30))
    return PendingLoRA(path.stem, scale, load, cache_hit=True)


def denoise_together(engine: DiffusionEngine,
                     requests: Sequence[tuple[GenerationParams, Sequence[PendingLoRA]]]) -> list[np.ndarray]:
    """The requests (each with its LoRAs applied from its first step) stepped as one batch to the end, decoded; a
    request with fewer steps (an edit, another scheduler) leaves the batch when done."""
    states = []
    for params, loras in requests:
        state = engine.start(params, list(loras))
        if loras:
            engine.activate_loras(state)
        states.append(state)
    while not all(state.done for state in states):
        engine.step([state for state in states if not state.done])
    return [engine.decode(state) for state in states]


def pipeline_images(pipe, params: GenerationParams, output_type: str = "np", **extra) -> np.ndarray:
    """The request through a diffusers pipeline (``extra``: its other arguments, e.g. ControlNet images, or prompt
    embeddings in place of the prompts) with the engine's generators (seed + i for image i), as float [n, H, W, 3]
    (``output_type="latent"``: its latents). An edit's image, mask (as PIL images) and strength go to an img2img or
    inpainting pipeline."""
    pipe.set_progress_bar_config(disable=True)
    if params.edit is not None:
        edit = params.edit
        extra |= {"image": Image.fromarray(edit.image), "strength": edit.strength}
        if edit.mask is not None:
            extra["mask_image"] = Image.fromarray(edit.mask)
    if "width" in inspect.signature(pipe.__call__).parameters:  # the img2img pipelines of SD and SDXL take none
        extra |= {"width": params.width, "height": params.height}
    if "prompt_embeds" not in extra:  # else the caller encoded the prompts (compel)
        extra |= {"prompt": params.prompt, "negative_prompt": params.negative_prompt}
    return pipe(num_images_per_prompt=params.n,
                num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                output_type=output_type,
                generator=[torch.Generator().manual_seed(params.seed + i) for i in range(params.n)], **extra).images
