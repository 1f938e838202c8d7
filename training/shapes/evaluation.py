"""Scoring generated images against what was asked: the quality checks of the trained ``tiny`` preset.

A ``Brief`` is what one generation asks for; ``fidelity``, ``control_iou`` and ``style`` score a batch of images
with the shapes-world measures. The images come from the caller (a diffusers pipeline, our engine, an HTTP
client), so the same scores judge every serving path.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from training.shapes.measures import (
    ShapeClassifier,
    colour_votes,
    darkness,
    dominant_colour,
    mask_iou,
    outline_score,
    shape_mask,
)
from training.shapes.world import BASE_WORLD, COLOURS, SHAPES, STYLE_WORLDS, ShapeSample, short_caption

#: Stream of the evaluation samples: never used by training (streams 1-9 of seed 0 are).
EVALUATION_STREAM = 1_000
#: Generation settings of ``evaluate_pipelines`` and of the quality tests: the defaults of deploy/serve_config.yaml.
EVALUATION_STEPS = 20
EVALUATION_GUIDANCE = 7.5


@dataclass(frozen=True)
class Brief:
    """One generation to judge: the sample it describes (its caption, and its edge map for ControlNet)."""

    sample: ShapeSample
    short: bool = False

    @property
    def prompt(self) -> str:
        return short_caption(self.sample.attributes) if self.short else self.sample.caption

    @property
    def control(self) -> np.ndarray:
        """The canny edge map as a ControlNet conditioning image (RGB, white on black)."""
        return self.sample.control("canny")


def briefs(n: int, *, short: bool = False, stream: int = EVALUATION_STREAM) -> list[Brief]:
    """``n`` briefs over filled shapes on white: every (colour, shape) pair once, in a seeded order, before any
    repeats (so a small ``n`` is balanced); geometry drawn from the seeded stream."""
    rng = np.random.default_rng(stream)
    pairs = [(colour, shape) for colour in COLOURS for shape in SHAPES]
    order = rng.permutation(len(pairs))
    chosen = []
    for i in range(n):
        colour, shape = pairs[order[i % len(pairs)]]
        attributes = dataclasses.replace(BASE_WORLD.sample_attributes(rng), colour=colour, shape=shape)
        chosen.append(Brief(BASE_WORLD.render(attributes), short=short))
    return chosen


@cache
def shape_classifier() -> ShapeClassifier:
    """The random forest the shape checks use (trained once per process on 2,000 generator images)."""
    return ShapeClassifier.trained(n=2000, seed=7)


def fidelity(images: Sequence[np.ndarray], wanted: Sequence[Brief]) -> dict[str, float]:
    """Share of images whose dominant colour (``colour``), and whose classified shape (``shape``), is the one
    asked for; and, finer-grained, the mean vote share of the asked colour among ink pixels (``colour_share``)
    and the classifier's mean probability of the asked shape (``shape_probability``)."""
    if len(images) != len(wanted):
        raise ValueError(f"{len(images)} images for {len(wanted)} briefs")
    classifier = shape_classifier()
    classes = classifier.classes
    rows = []
    for image, probability, brief in zip(images, classifier.predict_proba(images), wanted, strict=True):
        colour, shape = brief.sample.attributes.colour, brief.sample.attributes.shape
        rows.append((dominant_colour(image) == colour, classes[int(probability.argmax())] == shape,
                     colour_votes(image)[colour], probability[classes.index(shape)]))
    means = np.asarray(rows, dtype=np.float64).mean(axis=0)
    return dict(zip(("colour", "shape", "colour_share", "shape_probability"), map(float, means), strict=True))


def control_iou(images: Sequence[np.ndarray], wanted: Sequence[Brief]) -> float:
    """Mean IoU of each image's silhouette with the silhouette its edge map was drawn from."""
    return float(np.mean([mask_iou(shape_mask(image), brief.sample.mask)
                          for image, brief in zip(images, wanted, strict=True)]))


def style(images: Sequence[np.ndarray]) -> dict[str, float]:
    """Mean outline score and darkness of the images (what the ``outlined`` and ``dark`` LoRAs change)."""
    return {"outline": float(np.mean([outline_score(image) for image in images])),
            "darkness": float(np.mean([darkness(image) for image in images]))}


def to_uint8(images: np.ndarray | Sequence[np.ndarray]) -> list[np.ndarray]:
    """Float images in [0, 1] (a pipeline's ``output_type="np"``) or uint8 arrays -> uint8 [H, W, 3] list."""
    return [image if image.dtype == np.uint8 else (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
            for image in images]


def evaluate_pipelines(directory: Path, n: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Quality figures of shipped weights through diffusers' own pipelines (an independent reference for the
    serving paths the tests check): prompt fidelity at guidance 7.5 and 1, ControlNet IoU with and without the
    edge map, each LoRA's style measure with and without it."""
    from serving.controlnet.models import load_controlnet
    from serving.presets import load_local

    components = load_local(directory)
    controlnet = load_controlnet(directory / "controlnet")
    pipe = components.as_pipeline()
    control_pipe = components.as_controlnet_pipeline([controlnet])
    for p in (pipe, control_pipe):
        p.set_progress_bar_config(disable=True)

    def run(pipeline: Any, wanted: list[Brief], guidance: float = EVALUATION_GUIDANCE,
            **extra: Any) -> list[np.ndarray]:
        generators = [torch.Generator().manual_seed(i) for i in range(len(wanted))]
        images = pipeline(prompt=[brief.prompt for brief in wanted], num_inference_steps=EVALUATION_STEPS,
                          guidance_scale=guidance, generator=generators, output_type="np", **extra).images
        return to_uint8(images)

    started = time.perf_counter()
    long, short = briefs(n), briefs(n, short=True)
    report: dict[str, Any] = {"briefs": n, "steps": EVALUATION_STEPS, "guidance": EVALUATION_GUIDANCE}
    guided, plain = run(pipe, long), run(pipe, short)  # each also the "without" side of a comparison below
    report["fidelity"] = {f"guidance_{EVALUATION_GUIDANCE}": fidelity(guided, long),
                          "guidance_1.0": fidelity(run(pipe, long, 1.0), long)}
    report["fidelity_short_prompts"] = fidelity(plain, short)
    controls = [Image.fromarray(brief.control) for brief in long]
    with_control = run(control_pipe, long, image=controls)
    report["controlnet"] = {"iou_with": control_iou(with_control, long),
                            "iou_without": control_iou(guided, long),
                            "fidelity_with": fidelity(with_control, long)}
    report["lora"] = {"none": style(plain)}
    for name in STYLE_WORLDS:
        pipe.load_lora_weights(directory / "loras", weight_name=f"{name}.safetensors", adapter_name=name)
        styled = run(pipe, short)
        report["lora"][name] = {**style(styled), "fidelity": fidelity(styled, short)}
        pipe.delete_adapters(name)
    report["seconds"] = round(time.perf_counter() - started, 1)
    log(f"[evaluate] {json.dumps(report)}")
    return report
