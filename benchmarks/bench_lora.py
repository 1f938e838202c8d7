"""LoRA serving overhead: vanilla diffusers (load + fuse per request) against swiftserve's engine.

In one run, on the ``sd15-shape`` preset (Stable Diffusion 1.5 architecture; ``--preset`` another), at 256x256 with
a few steps and a LoRA the size of a real one (rank 64 on every attention projection):

- diffusers, no LoRA                       the pipeline alone
- diffusers, LoRA per request              load_lora_weights + fuse_lora, generate, unfuse + unload
- swiftserve, no LoRA                      the engine loop, the serving path
- swiftserve, cold LoRA                    not in the cache: loaded in the background while denoising
- swiftserve, warm LoRA                    in the host cache: applied from step 0 (one request in the
                                           batch: a merged copy of the targeted weights; base untouched)

and prints each latency with the latency added over the same side's no-LoRA run.

Cases run interleaved (round robin) and medians are reported: this machine's timings drift.

    .venv/bin/python -m benchmarks.bench_lora [--steps 6] [--size 256] [--repeats 5] [--preset sd15-shape] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.common import diffusion_arguments, write_attention_lora
from benchmarks.records import RESULTS, machine, provenance, summary, timed, write_results
from serving.config import EngineConfig
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, GenerationResult, LoRASpec
from serving.lora.cache import LoRACache
from serving.lora.format import LoRATargets
from serving.lora.registry import LoRARegistry
from serving.preset_catalog import PRESET_NAMES
from serving.presets import build_preset


def diffusers_cases(preset: str, params: GenerationParams, lora_path: Path) -> dict[str, Callable[[], None]]:
    pipe = build_preset(preset).as_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def generate() -> None:
        pipe(prompt=params.prompt, width=params.width, height=params.height,
             num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
             generator=torch.Generator().manual_seed(params.seed), output_type="np")

    def generate_with_lora() -> None:
        pipe.load_lora_weights(str(lora_path.parent), weight_name=lora_path.name, local_files_only=True)
        pipe.fuse_lora(lora_scale=1.0)
        generate()
        pipe.unfuse_lora()
        pipe.unload_lora_weights()

    return {"no LoRA": generate, "LoRA load+fuse per request": generate_with_lora}


class SwiftserveCases:
    """The serving path (engine loop + LoRA cache) with a LoRA directory of its own."""

    def __init__(self, preset: str, params: GenerationParams, lora_path: Path) -> None:
        self.params, self.lora_path = params, lora_path
        engine = DiffusionEngine(preset, build_preset(preset), torch.device("cpu"))
        self.cache = LoRACache(LoRARegistry(lora_path.parent), engine.lora_targets, budget_bytes=2**31,
                               max_file_bytes=2**31)
        self.loop = EngineLoop(engine, EngineConfig(), self.cache)
        self.reports: dict[str, list[dict]] = {"cold": [], "warm": []}
        self._cold_names = iter(range(10**6))

    def cases(self) -> dict[str, Callable[[], None]]:
        return {"no LoRA": self.plain, "cold LoRA (background load)": self.cold,
                "warm LoRA (cached)": self.warm}

    def _generate(self, loras: tuple[LoRASpec, ...] = ()) -> GenerationResult:
        return self.loop.submit(replace(self.params, loras=loras)).result()

    def plain(self) -> None:
        self._generate()

    def cold(self) -> None:
        name = f"cold{next(self._cold_names)}"  # a new file name is a cache miss: read, converted, applied late
        shutil.copy(self.lora_path, self.lora_path.parent / f"{name}.safetensors")
        self.reports["cold"].append(asdict(self._generate((LoRASpec(name, 1.0),)).lora))

    def warm(self) -> None:
        self.cache.get(self.lora_path.stem).result()
        self.reports["warm"].append(asdict(self._generate((LoRASpec(self.lora_path.stem, 1.0),)).lora))

    def close(self) -> None:
        self.loop.stop()
        self.cache.close()


def main() -> None:
    args, params = diffusion_arguments(__doc__, steps=6, repeats=5, options=_options)
    source = provenance()  # before this run writes its results into the tree

    with tempfile.TemporaryDirectory() as tmp:
        lora_path = Path(tmp) / "style.safetensors"
        components = build_preset(args.preset)
        file_bytes = write_attention_lora(lora_path, LoRATargets.from_modules(components.denoiser,
                                                                             components.text_encoder), args.rank)
        del components
        print(f"LoRA file: rank {args.rank}, {file_bytes / 2**20:.1f} MiB; {args.size}x{args.size}, "
              f"{args.steps} steps, CFG; {torch.get_num_threads()} torch threads", flush=True)
        ours = SwiftserveCases(args.preset, params, lora_path)
        cases = {("diffusers", name): run for name, run in diffusers_cases(args.preset, params, lora_path).items()}
        cases |= {("swiftserve", name): run for name, run in ours.cases().items()}
        try:
            for (_, case), run in cases.items():  # warm-up, one per system
                if case == "no LoRA":
                    run()
            seconds: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
            for repeat in range(args.repeats):  # interleaved, so drift on a shared machine hits every case alike
                for key, run in cases.items():
                    seconds[key] += timed(run, 1)
                    print(f"  [{repeat + 1}/{args.repeats}] {key[0]:<10} {key[1]:<28} {seconds[key][-1]:6.2f} s",
                          flush=True)
        finally:
            ours.close()

    rows = [(system, case, runs, seconds[(system, "no LoRA")]) for (system, case), runs in seconds.items()]
    lines = [
        f"# LoRA overhead: {args.preset}, {args.size}x{args.size}, {args.steps} steps, rank-{args.rank} LoRA "
        f"({file_bytes / 2**20:.0f} MiB), {machine()['device']}, {torch.get_num_threads()} threads",
        "",
        "| system | case | median latency (s) | added over its no-LoRA median |",
        "|---|---|---|---|",
    ]
    added_by_case: dict[str, float] = {}
    payload: dict[str, object] = {**source, "machine": machine(), "args": vars(args),
                                  "summary": added_by_case,
                                  "lora_file_bytes": file_bytes, "swiftserve_lora_reports": ours.reports,
                                  "cases": []}
    for system, case, runs, baseline in rows:
        stats, base = summary(runs), summary(baseline)["median_s"]
        added = stats["median_s"] / base - 1.0
        lines.append(f"| {system} | {case} | {stats['median_s']:.2f} | {added:+.1%} |")
        payload["cases"].append({"system": system, "case": case, **stats, "added_fraction": added})
        if case != "no LoRA":
            added_by_case[summary_key(system, case)] = added
    lines += ["", f"Summary: the fraction each LoRA case adds to its system's no-LoRA median: "
              f"{', '.join(f'`{key}` {value:+.3f}' for key, value in added_by_case.items())}. "
              f"Commit `{source['commit']}`, {source['date']}: `{source['command']}`."]
    table = "\n".join(lines)
    print(table)
    write_results("bench_lora", payload, table, args.out)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="sd15-shape", choices=PRESET_NAMES, help="model preset (tiny: a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")


def summary_key(system: str, case: str) -> str:
    """``added_<system>_<case>`` in lower snake case: ``("swiftserve", "warm LoRA (cached)")`` ->
    ``added_swiftserve_warm_lora_cached``."""
    return "added_" + "_".join(re.findall(r"[a-z0-9]+", f"{system} {case}".lower()))


if __name__ == "__main__":
    main()
