"""ControlNets and LoRAs per request: vanilla diffusers against swiftserve's engine, Katz's rows.

In one run, on the ``sd15-shape`` preset at 256x256 with a few steps, for each row of the Katz table
(0c-0l, 1c-1l, 2c-2l, 3c-2l: ControlNets - LoRAs):

- diffusers: ``StableDiffusionControlNetPipeline`` (``MultiControlNetModel`` for several), the
  request's LoRAs loaded and fused before it and unloaded after it (what a shared server must do);
- swiftserve: the engine loop with in-process ControlNet services and the LoRA cache (LoRAs
  cached: the steady state of a server whose popular LoRAs are warm).

Cases run interleaved (round robin); medians and the ratio diffusers / swiftserve are printed and
written to ``benchmarks/results/bench_diffusion.{json,md}``.

    .venv/bin/python -m benchmarks.bench_diffusion [--steps 4] [--size 256] [--repeats 3]
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from PIL import Image

from benchmarks.common import (
    conditioning_image,
    diffusion_arguments,
    machine,
    summary,
    timed,
    write_attention_lora,
    write_results,
)
from serving.config import EngineConfig
from serving.controlnet.client import LocalControlNets
from serving.controlnet.models import build_controlnet_preset
from serving.controlnet.runner import ControlNetRunner
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, LoRASpec
from serving.engine.types import ControlNetSpec
from serving.lora.cache import LoRACache
from serving.lora.format import LoRATargets
from serving.lora.registry import LoRARegistry
from serving.presets import build_preset

ROWS = ((0, 0), (1, 1), (2, 2), (3, 2))  # (ControlNets, LoRAs), as in the Katz logs
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Row:
    controlnets: int
    loras: int

    @property
    def label(self) -> str:
        return f"{self.controlnets}c-{self.loras}l"


class Diffusers:
    def __init__(self, controlnets: list, lora_dir: Path, params: GenerationParams) -> None:
        components = build_preset("sd15-shape")
        self.controlnets, self.lora_dir, self.params = controlnets, lora_dir, params
        self.pipes = {}
        for count in {controlnet_count for controlnet_count, _ in ROWS if controlnet_count}:
            self.pipes[count] = components.as_controlnet_pipeline(controlnets[:count])
            self.pipes[count].set_progress_bar_config(disable=True)
        self.plain = components.as_pipeline()
        self.plain.set_progress_bar_config(disable=True)

    def run(self, row: Row) -> None:
        pipe = self.pipes.get(row.controlnets, self.plain)
        names = [f"lora{i}" for i in range(row.loras)]
        for name in names:
            pipe.load_lora_weights(str(self.lora_dir), weight_name=f"{name}.safetensors", adapter_name=name,
                                   local_files_only=True)
        if names:
            pipe.set_adapters(names, [0.8] * len(names))
            pipe.fuse_lora(adapter_names=names)
        kwargs = {}
        if row.controlnets:
            images = [Image.fromarray(conditioning_image(self.params.width, i)) for i in range(row.controlnets)]
            kwargs = {"image": images[0] if row.controlnets == 1 else images,
                      "controlnet_conditioning_scale": 1.0 if row.controlnets == 1 else [1.0] * row.controlnets}
        pipe(prompt=self.params.prompt, width=self.params.width, height=self.params.height,
             num_inference_steps=self.params.num_inference_steps, guidance_scale=self.params.guidance_scale,
             generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
        if names:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()


class Swiftserve:
    def __init__(self, controlnets: list, lora_dir: Path, params: GenerationParams) -> None:
        client = LocalControlNets({f"cn{i}": ControlNetRunner(net, CPU) for i, net in enumerate(controlnets)})
        engine = DiffusionEngine("sd15-shape", build_preset("sd15-shape"), CPU, controlnets=client)
        self.cache = LoRACache(LoRARegistry(lora_dir), engine.lora_targets, budget_bytes=2**32, max_file_bytes=2**31)
        self.loop = EngineLoop(engine, EngineConfig(), self.cache)
        self.params = params
        self.reports: list[dict] = []

    def run(self, row: Row) -> None:
        loras = tuple(LoRASpec(f"lora{i}", 0.8) for i in range(row.loras))
        controls = tuple(ControlNetSpec(f"cn{i}", conditioning_image(self.params.width, i), 1.0)
                         for i in range(row.controlnets))
        result = self.loop.submit(replace(self.params, loras=loras, controlnets=controls)).result()
        if result.lora is not None:
            self.reports.append({"row": row.label, **asdict(result.lora)})

    def close(self) -> None:
        self.loop.stop()
        self.cache.close()


def main() -> None:
    args, params = diffusion_arguments(__doc__, steps=4, repeats=3)
    rows = [Row(*row) for row in ROWS]
    controlnets = [build_controlnet_preset("sd15-shape", seed=i) for i in range(3)]
    with tempfile.TemporaryDirectory() as tmp:
        lora_dir = Path(tmp)
        vanilla = Diffusers(controlnets, lora_dir, params)
        targets = LoRATargets.from_modules(vanilla.plain.unet, vanilla.plain.text_encoder)
        for i in range(2):
            write_attention_lora(lora_dir / f"lora{i}.safetensors", targets, args.rank, seed=i)
        ours = Swiftserve(controlnets, lora_dir, params)
        systems: dict[str, Callable[[Row], None]] = {"diffusers": vanilla.run, "swiftserve": ours.run}
        print(f"sd15-shape, {args.size}x{args.size}, {args.steps} steps, CFG, rank-{args.rank} LoRAs; "
              f"{torch.get_num_threads()} torch threads", flush=True)
        try:
            for run in systems.values():  # warm-up, and every LoRA into swiftserve's cache
                run(Row(3, 2))
            seconds = {(system, row.label): [] for system in systems for row in rows}
            for repeat in range(args.repeats):
                for row in rows:
                    for system, run in systems.items():
                        seconds[(system, row.label)] += timed(lambda run=run, row=row: run(row), 1)
                        print(f"  [{repeat + 1}/{args.repeats}] {system:<10} {row.label}  "
                              f"{seconds[(system, row.label)][-1]:6.2f} s", flush=True)
        finally:
            ours.close()

    lines = [
        f"# ControlNets and LoRAs: sd15-shape, {args.size}x{args.size}, {args.steps} steps, "
        f"{machine()['device']}, {torch.get_num_threads()} threads",
        "",
        "| row | diffusers median (s) | swiftserve median (s) | diffusers / swiftserve | swiftserve vs its 0c-0l |",
        "|---|---|---|---|---|",
    ]
    payload: dict[str, object] = {"machine": machine(), "args": vars(args), "rows": [],
                                  "swiftserve_lora_reports": ours.reports}
    base = summary(seconds[("swiftserve", "0c-0l")])["median_s"]
    for row in rows:
        theirs, mine = summary(seconds[("diffusers", row.label)]), summary(seconds[("swiftserve", row.label)])
        ratio = theirs["median_s"] / mine["median_s"]
        lines.append(f"| {row.label} | {theirs['median_s']:.2f} | {mine['median_s']:.2f} | {ratio:.2f}x | "
                     f"{mine['median_s'] / base:.2f}x |")
        payload["rows"].append({"row": row.label, "diffusers": theirs, "swiftserve": mine, "ratio": ratio})
    table = "\n".join(lines)
    print(table)
    write_results("bench_diffusion", payload, table)


if __name__ == "__main__":
    main()
