"""Shared plumbing of the benchmark scripts: timing, machine description, result files, generated inputs."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from serving.engine import GenerationParams
from serving.lora.format import LoRATargets

RESULTS = Path(__file__).resolve().parent / "results"

ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def write_attention_lora(path: Path, targets: LoRATargets, rank: int, seed: int = 0) -> int:
    """A PEFT-format fp16 LoRA of ``rank`` on every UNet attention projection; returns its size in bytes."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in targets.unet.items():
        if not name.endswith(ATTENTION_PROJECTIONS):
            continue
        tensors[f"unet.{name}.lora_A.weight"] = (torch.randn(rank, shape.in_features, generator=generator)
                                                 / shape.in_features**0.5).half()
        tensors[f"unet.{name}.lora_B.weight"] = (torch.randn(shape.out_features, rank, generator=generator)
                                                 * 0.01).half()
    save_file(tensors, str(path))
    return path.stat().st_size


def conditioning_image(size: int, index: int) -> np.ndarray:
    """A white rectangle on black, in one of two places by the parity of ``index``."""
    image = np.zeros((size, size, 3), np.uint8)
    quarter = size // 4
    image[quarter * (index % 2): quarter * (index % 2 + 2), quarter: quarter * 3] = 255
    return image


def machine() -> dict[str, object]:
    """Where the numbers were measured."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "device": device,
        "cuda": torch.cuda.is_available(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def timed(run: Callable[[], object], repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``run``."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def summary(seconds: list[float]) -> dict[str, float]:
    return {"mean_s": statistics.fmean(seconds), "median_s": statistics.median(seconds),
            "min_s": min(seconds), "max_s": max(seconds), "runs": len(seconds)}


def write_results(name: str, payload: dict, table: str) -> None:
    """``results/<name>.json`` (everything) and ``results/<name>.md`` (the table people read)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(table + "\n")


def diffusion_arguments(doc: str, *, steps: int, repeats: int) -> tuple[argparse.Namespace, GenerationParams]:
    """Command line shared by the diffusion benchmarks, and the request every case starts from."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rank", type=int, default=64, help="rank of the LoRA files")
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args()
    params = GenerationParams(prompt="a red circle on a white background", width=args.size, height=args.size,
                              num_inference_steps=args.steps, guidance_scale=7.5, seed=0)
    return args, params
