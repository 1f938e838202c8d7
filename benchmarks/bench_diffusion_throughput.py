"""Throughput under a production-like mix: swiftserve's Serve app against vanilla diffusers in Serve.

Both run on one Ray cluster of the same size (``--cpus``), one system after the other, driven by the
same seeded request sequence from ``--clients`` concurrent clients: a Zipf mix of ControlNets (few
dominate) and LoRAs (a long tail, from ``--loras`` files), ``sd15-shape`` at 256x256.

- swiftserve: the diffusion app (``DiffusionModel`` with step-level batching and its LoRA cache, one
  ``ControlNetService`` deployment per ControlNet), called through its deployment handle;
- vanilla: one deployment holding ``StableDiffusionControlNetPipeline`` with every ControlNet, one
  request at a time, the request's LoRAs loaded and fused before it and unloaded after it.

Prints requests per minute, p50 and p99 latency, and the throughput ratio; writes
``benchmarks/results/bench_diffusion_throughput.{json,md}``.

    .venv/bin/python -m benchmarks.bench_diffusion_throughput [--requests 16] [--clients 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import ray
import torch
from PIL import Image
from ray import serve

from benchmarks.common import conditioning_image, machine, write_attention_lora, write_results
from serving.app import build_app
from serving.config import ControlNetConfig, DiffusionAppConfig, DiffusionModelConfig, GenerationDefaults, LoRAConfig
from serving.engine import GenerationParams, LoRASpec
from serving.engine.types import ControlNetSpec
from serving.lora.format import LoRATargets
from serving.presets import build_preset

CONTROLNETS = 3


@dataclass(frozen=True)
class Job:
    controlnets: tuple[int, ...]
    loras: tuple[int, ...]


def zipf_choice(rng: np.random.Generator, n: int, exponent: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    return int(rng.choice(n, p=weights / weights.sum()))


def request_mix(count: int, lora_files: int, seed: int = 0) -> list[Job]:
    """Per request 0-2 ControlNets (Zipf over 3, s=1.5) and 0-2 LoRAs (Zipf over the files, s=1.1)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for _ in range(count):
        controlnets = {zipf_choice(rng, CONTROLNETS, 1.5) for _ in range(int(rng.choice(3, p=[0.3, 0.5, 0.2])))}
        loras = {zipf_choice(rng, lora_files, 1.1) for _ in range(int(rng.choice(3, p=[0.3, 0.5, 0.2])))}
        jobs.append(Job(tuple(sorted(controlnets)), tuple(sorted(loras))))
    return jobs


def to_params(job: Job, base: GenerationParams) -> GenerationParams:
    return replace(
        base,
        loras=tuple(LoRASpec(f"lora{i}", 0.8) for i in job.loras),
        controlnets=tuple(ControlNetSpec(f"cn{i}", conditioning_image(base.width, i), 1.0) for i in job.controlnets),
    )


@serve.deployment(ray_actor_options={"num_cpus": 2}, max_ongoing_requests=64)
class VanillaDiffusers:
    """diffusers as a shared server must use it: every ControlNet loaded, LoRAs fused per request."""

    def __init__(self, lora_dir: str, threads: int) -> None:
        from serving.controlnet.models import build_controlnet_preset

        torch.set_num_threads(threads)
        components = build_preset("sd15-shape")
        self.nets = [build_controlnet_preset("sd15-shape", seed=i) for i in range(CONTROLNETS)]
        self.components, self.lora_dir = components, lora_dir
        self.plain = components.as_pipeline()
        self.lock = threading.Lock()

    def generate(self, params: GenerationParams) -> int:
        with self.lock:
            if params.controlnets:
                pipe = self.components.as_controlnet_pipeline(
                    [self.nets[int(spec.name[2:])] for spec in params.controlnets])
                images = [Image.fromarray(spec.image) for spec in params.controlnets]
                extra = {"image": images[0] if len(images) == 1 else images,
                         "controlnet_conditioning_scale": 1.0 if len(images) == 1 else [1.0] * len(images)}
            else:
                pipe, extra = self.plain, {}
            pipe.set_progress_bar_config(disable=True)
            names = [spec.name for spec in params.loras]
            for name in names:
                pipe.load_lora_weights(self.lora_dir, weight_name=f"{name}.safetensors", adapter_name=name,
                                       local_files_only=True)
            if names:
                pipe.set_adapters(names, [spec.scale for spec in params.loras])
                pipe.fuse_lora(adapter_names=names)
            try:
                pipe(prompt=params.prompt, width=params.width, height=params.height,
                     num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                     generator=torch.Generator().manual_seed(params.seed), output_type="np", **extra)
            finally:
                if names:
                    pipe.unfuse_lora()
                    pipe.unload_lora_weights()
            return len(names)


def drive(handle, jobs: list[Job], base: GenerationParams, clients: int) -> dict[str, float]:
    latencies: list[float] = []

    def one(job: Job) -> None:
        started = time.perf_counter()
        handle.generate.remote(to_params(job, base)).result(timeout_s=3600)
        latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, jobs))
    elapsed = time.perf_counter() - started
    return {"requests": len(jobs), "seconds": elapsed, "requests_per_minute": 60 * len(jobs) / elapsed,
            "p50_s": float(np.percentile(latencies, 50)), "p99_s": float(np.percentile(latencies, 99))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--loras", type=int, default=12, help="LoRA files in the pool (rank 64)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the Ray cluster, for each system")
    args = parser.parse_args()
    base = GenerationParams(prompt="a red circle on a white background", width=args.size, height=args.size,
                            num_inference_steps=args.steps, guidance_scale=7.5, seed=0)
    jobs = request_mix(args.requests, args.loras)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        lora_dir = Path(tmp)
        components = build_preset("sd15-shape")
        targets = LoRATargets.from_modules(components.unet, components.text_encoder)
        del components
        for i in range(args.loras):
            write_attention_lora(lora_dir / f"lora{i}.safetensors", targets, rank=64, seed=i)
        ray.init(num_cpus=args.cpus, include_dashboard=False, object_store_memory=2 * 2**30)
        try:
            config = DiffusionAppConfig(
                model=DiffusionModelConfig(name="sd15", preset="sd15-shape", torch_threads=args.cpus),
                defaults=GenerationDefaults(num_inference_steps=args.steps),
                lora=LoRAConfig(directory=lora_dir),
                controlnets=[ControlNetConfig(name=f"cn{i}", preset="sd15-shape", seed=i, torch_threads=args.cpus)
                             for i in range(CONTROLNETS)],
            )
            print(f"{len(jobs)} requests, {args.clients} clients, {args.cpus} CPUs, "
                  f"{args.size}x{args.size}, {args.steps} steps", flush=True)
            serve.run(build_app(config), name="ours", route_prefix=None)
            model = serve.get_deployment_handle("DiffusionModel", app_name="ours")
            model.generate.remote(base).result(timeout_s=3600)  # warm-up
            results["swiftserve"] = drive(model, jobs, base, args.clients)
            print("swiftserve", results["swiftserve"], flush=True)
            serve.delete("ours")
            vanilla = serve.run(VanillaDiffusers.bind(str(lora_dir), args.cpus), name="vanilla", route_prefix=None)
            vanilla.generate.remote(base).result(timeout_s=3600)  # warm-up
            results["vanilla diffusers"] = drive(vanilla, jobs, base, args.clients)
            print("vanilla", results["vanilla diffusers"], flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()

    ratio = results["swiftserve"]["requests_per_minute"] / results["vanilla diffusers"]["requests_per_minute"]
    lines = [
        f"# Throughput, Zipf mix of ControlNets and LoRAs: sd15-shape {args.size}x{args.size}, {args.steps} steps, "
        f"{args.requests} requests from {args.clients} clients, {args.cpus} CPUs ({machine()['device']})",
        "",
        "| system | requests/min | p50 (s) | p99 (s) |",
        "|---|---|---|---|",
        *[f"| {name} | {r['requests_per_minute']:.2f} | {r['p50_s']:.1f} | {r['p99_s']:.1f} |"
          for name, r in results.items()],
        "",
        f"Throughput ratio swiftserve / vanilla: {ratio:.2f}x",
    ]
    table = "\n".join(lines)
    print(table)
    write_results("bench_diffusion_throughput", {"machine": machine(), "args": vars(args), "results": results,
                                                 "ratio": ratio, "jobs": [vars(job) for job in jobs]}, table)


if __name__ == "__main__":
    main()
