"""One UNet step's cost when every row of the batch has its own LoRA (issue 19), against no LoRA and one merged LoRA.

Each measurement is one ``DiffusionEngine.predict_noise`` call, what the engine loop runs per step, timed as the
second of two consecutive steps of the same batch (a batch steps many times; per-batch state such as stacked LoRA
factors is built in its first step, timed apart as ``first_step``): a ``RowBatch`` of 8 rows (at 8 different
timesteps, as from 8 requests; a 77-token context), the ``sd15-shape`` preset at 256x256 (32x32 latents). For
each LoRA rank (8 and 64; PEFT files on every attention projection, loaded as the LoRA cache loads them):

- none                 no row has a LoRA, on an engine that never served one (no LoRA hooks): the baseline
- none, hooked         no row has a LoRA, on the engine the LoRA cases run on (its LoRA modules are hooked, as in
                       an engine that has served LoRAs)
- mixed                each row its own LoRA: the unmerged path (the rows' factors stacked, two batched matmuls)
- merged               every row the same LoRA, from its merged weight copy (built and checked before timing; the
                       merged cache sized to hold every rank's whole)
- same, unmerged       every row the same LoRA on an engine with the merged cache off (a reference)

A warm-up round runs every case, then the cases run interleaved (round robin), so each case's first step follows
another case's; median, min and max per case.
A ratio's range runs from min/max to max/min of the two cases' runs: a range that holds 1.0 is a tie.

    .venv/bin/python -m benchmarks.bench_lora_batch [--size 256] [--rows 8] [--ranks 8 64] [--repeats 5]
        [--threads N (default: every core)] [--device auto] [--preset sd15-shape] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import sharing_weights, write_attention_lora
from benchmarks.records import RESULTS, machine, provenance, summary, timed, write_results
from serving.common.device import resolve_device, set_torch_threads
from serving.config import LoRAConfig
from serving.engine import DiffusionEngine
from serving.engine.rows import RowBatch, RowLoRAs
from serving.lora.format import load_lora_file
from serving.lora.weights import LoRAWeights
from serving.presets import build_preset

NAME = "bench_lora_batch"
GOAL = ("mixed", 64, 1.25)  # issue 19: ratio_mixed_to_none_rank64 <= 1.25 (S-LoRA/Punica-class)
SUMMARY = (("mixed", 64), ("mixed", 8), ("merged", 64))  # the ratios the issue names, as (case, rank)
DESCRIPTIONS = {
    "none": "no LoRA, engine without LoRA hooks",
    "none_hooked": "no LoRA, engine with LoRA hooks",
    "mixed": "a different LoRA per row (unmerged)",
    "merged": "one LoRA on every row, merged copy",
    "same_unmerged": "one LoRA on every row, unmerged (merged cache off)",
}


@dataclass(frozen=True)
class Case:
    kind: str  # a key of DESCRIPTIONS
    rank: int | None
    engine: DiffusionEngine
    batch: RowBatch

    @property
    def label(self) -> str:
        return self.kind if self.rank is None else f"{self.kind} r{self.rank}"

    def run(self) -> None:
        self.engine.predict_noise(self.batch)

    def two_steps(self) -> tuple[float, float]:
        """Seconds of two consecutive steps of the batch: the first (after another case), the second (steady)."""
        first = timed(self.run, 1)[0]
        return first, timed(self.run, 1)[0]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--rows", type=int, default=8, help="rows of the UNet batch (and LoRAs of the mixed case)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: every core)")
    parser.add_argument("--device", default="auto", help="auto: CUDA (float16) when present, else CPU (float32)")
    parser.add_argument("--preset", default="sd15-shape", help="model preset (tiny: a smoke run)")
    parser.add_argument("--out", help="directory of the result files (default: benchmarks/results)")
    args = parser.parse_args()
    if args.rows < 2 or args.repeats < 1:
        parser.error("--rows must be at least 2 and --repeats at least 1")
    return args


def row_batch(engine: DiffusionEngine, size: int, loras: Sequence[RowLoRAs]) -> RowBatch:
    """Seeded latents and context (the same for every case), each row at its own timestep, with ``loras``."""
    rows, latent = len(loras), size // engine.vae_scale_factor
    generator = torch.Generator().manual_seed(0)
    unet = engine.denoiser.module
    sample = torch.randn(rows, unet.config.in_channels, latent, latent, generator=generator)
    context = torch.randn(rows, engine.prompts.tokenizer.model_max_length, unet.config.cross_attention_dim,
                          generator=generator)
    timestep = torch.linspace(engine.base_scheduler.config.num_train_timesteps - 1, 0, rows).round().long()
    context = context.to(engine.device, engine.dtype)
    return RowBatch(sample=sample.to(engine.device, engine.dtype), timestep=timestep.to(engine.device),
                    context=context, context_rows=[(context, row) for row in range(rows)], loras=list(loras),
                    controls=[()] * rows)


def write_loras(directory: Path, engine: DiffusionEngine, rank: int, count: int) -> tuple[list[LoRAWeights], int]:
    """``count`` different rank-``rank`` LoRA files, loaded as the LoRA cache loads them; and one file's bytes."""
    weights, file_bytes = [], 0
    for seed in range(count):
        path = directory / f"rank{rank}-{seed}.safetensors"
        file_bytes = write_attention_lora(path, engine.lora_targets, rank, seed=seed)
        weights.append(load_lora_file(path, engine.lora_targets, max_file_bytes=LoRAConfig().max_file_bytes))
    return weights, file_bytes


def merged_copy_bytes(engine: DiffusionEngine) -> int:
    """Bytes of the merged weight copies held by the engine's UNet LoRA hooks (private state, read as the unit
    tests read it)."""
    merged = engine._denoiser_loras._merged
    return merged._bytes if merged is not None else 0


def touched_weight_bytes(engine: DiffusionEngine, weights: LoRAWeights) -> int:
    """Bytes of the UNet weights ``weights`` changes: what its full merged copy takes."""
    modules = dict(engine.denoiser.module.named_modules())
    return sum(modules[name].weight.numel() * modules[name].weight.element_size() for name in weights.denoiser)


def ratio(runs: list[float], baseline: list[float]) -> dict[str, float | bool]:
    """Median over median, and the range min/max .. max/min; ``tie`` when that range holds 1.0."""
    low, high = min(runs) / max(baseline), max(runs) / min(baseline)
    return {"median": statistics.median(runs) / statistics.median(baseline), "min": low, "max": high,
            "tie": low <= 1.0 <= high}


def main() -> None:
    args = arguments()
    set_torch_threads(args.threads)
    device = resolve_device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    # Timed forwards take the same path whatever ``merge_after`` is; 0 builds each merged copy in its first forward.
    # The merged cache holds every rank's merged case whole: a copy of the whole denoiser per rank bounds them
    # (``auto``, the server's default, sizes it for one LoRA combination at a time).
    components = build_preset(args.preset)
    denoiser_bytes = sum(weight.nbytes for weight in components.denoiser.parameters())
    engine = DiffusionEngine(args.preset, components, device, dtype,
                             merged_lora_bytes=len(args.ranks) * denoiser_bytes, lora_merge_after=0)
    reference = DiffusionEngine(args.preset, build_preset(args.preset), device, dtype, merged_lora_bytes=0)
    bare = DiffusionEngine(args.preset, sharing_weights(components), device, dtype)  # never sees a LoRA
    if args.size % engine.info.size_multiple:
        raise SystemExit(f"--size must be a multiple of {engine.info.size_multiple}")

    cases = [Case("none", None, bare, row_batch(bare, args.size, [()] * args.rows)),
             Case("none_hooked", None, engine, row_batch(engine, args.size, [()] * args.rows))]
    file_bytes: dict[int, int] = {}
    expected_merged = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rank in args.ranks:
            host, file_bytes[rank] = write_loras(Path(tmp), engine, rank, args.rows)
            own = [engine.lora_on_device(weights) for weights in host]  # as activate_loras: one copy per LoRA
            shared = reference.lora_on_device(host[0])
            cases += [
                Case("mixed", rank, engine, row_batch(engine, args.size, [((weights, 1.0),) for weights in own])),
                Case("merged", rank, engine, row_batch(engine, args.size, [((own[0], 1.0),)] * args.rows)),
                Case("same_unmerged", rank, reference,
                     row_batch(reference, args.size, [((shared, 1.0),)] * args.rows)),
            ]
            expected_merged += touched_weight_bytes(engine, own[0])
    print(f"{args.preset}, {args.size}x{args.size}, {args.rows} rows, ranks {args.ranks}, {device} {dtype}, "
          f"{torch.get_num_threads()} torch threads; LoRA files (bytes): {file_bytes}", flush=True)

    merge_build_s = {case.label: timed(case.run, 1)[0] for case in cases if case.kind == "merged"}
    check_merged(engine, expected_merged, "after building")
    warmup_s = {case.label: timed(case.run, 1)[0] for case in cases}
    seconds: dict[str, list[float]] = {case.label: [] for case in cases}
    first_step: dict[str, list[float]] = {case.label: [] for case in cases}
    for repeat in range(args.repeats):  # interleaved, so drift on a shared machine hits every case alike
        for case in cases:
            first, steady = case.two_steps()
            first_step[case.label].append(first)
            seconds[case.label].append(steady)
            print(f"  [{repeat + 1}/{args.repeats}] {case.label:<18} {steady:8.4f} s (first step {first:8.4f} s)",
                  flush=True)
    check_merged(engine, expected_merged, "after timing")
    if bare._denoiser_loras._wrapped or not engine._denoiser_loras._wrapped:  # private state, as check_merged reads
        raise SystemExit("the `none` engine must have no LoRA hooks and the LoRA cases' engine must have them")

    none = seconds["none"]
    rows = [{"case": case.kind, "rank": case.rank, "description": DESCRIPTIONS[case.kind],
             "seconds": seconds[case.label], **summary(seconds[case.label]),
             "first_step_seconds": first_step[case.label],
             "first_step_median_s": statistics.median(first_step[case.label]),
             "ratio_to_none": ratio(seconds[case.label], none)} for case in cases]
    by_key = {(row["case"], row["rank"]): row for row in rows}
    results = {f"ratio_{kind}_to_none_rank{rank}": by_key[(kind, rank)]["ratio_to_none"]["median"]
               for kind, rank in SUMMARY if (kind, rank) in by_key}
    payload = {
        **provenance(),
        "machine": machine() | {"engine_device": str(device), "dtype": str(dtype).removeprefix("torch.")},
        "args": vars(args),
        "setup": {"preset": args.preset, "rows": args.rows, "latent_side": args.size // engine.vae_scale_factor,
                  "context_tokens": engine.prompts.tokenizer.model_max_length,
                  "timesteps": cases[0].batch.timestep.tolist(), "lora_file_bytes": file_bytes,
                  "merged_copy_bytes": expected_merged, "merge_build_forward_s": merge_build_s,
                  "warmup_s": warmup_s},
        "rows": rows,
        "summary": results,
    }
    table = markdown(payload, rows)
    print(table)
    write_results(NAME, payload, table, Path(args.out) if args.out else RESULTS)


def check_merged(engine: DiffusionEngine, expected: int, when: str) -> None:
    """Every merged case's copy covers all its modules: the timed merged forwards run merged weights only."""
    held = merged_copy_bytes(engine)
    if held != expected:
        raise SystemExit(f"merged copies hold {held} bytes {when}, {expected} expected: the merged cache "
                         f"({engine._denoiser_loras.merged_budget_bytes} bytes) does not keep every merged case whole")


def markdown(payload: dict, rows: list[dict]) -> str:
    args, setup, env = payload["args"], payload["setup"], payload["machine"]
    side = setup["latent_side"]
    lines = [
        f"# One UNet step with a LoRA per row: {args['preset']}, {args['rows']} rows, {args['size']}x{args['size']} "
        f"({side}x{side} latents), {env['engine_device']} {env['dtype']}, {env['torch_threads']} torch threads",
        "",
        "| case | rank | median (s) | min (s) | max (s) | / no LoRA (median) | / no LoRA (range) | | first step, "
        "median (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row["ratio_to_none"]
        tie = "tie (range holds 1.0)" if r["tie"] and row["case"] != "none" else ""
        lines.append(f"| {row['description']} | {row['rank'] or '-'} | {row['median_s']:.4f} | {row['min_s']:.4f} | "
                     f"{row['max_s']:.4f} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} | {tie} | "
                     f"{row['first_step_median_s']:.4f} |")
    lines += ["", "Summary: " + ", ".join(f"`{key}` = {value:.3f}" for key, value in payload["summary"].items())]
    kind, rank, goal = GOAL
    key = f"ratio_{kind}_to_none_rank{rank}"
    if key in payload["summary"]:
        met = "met" if payload["summary"][key] <= goal else "not met"
        lines.append(f"Goal (issue 19): `{key}` <= {goal}: {met}.")
    lines += ["", f"Steady state: the second of two consecutive steps of a batch; first step: the step before it, "
                  f"right after another case ran. {args['repeats']} interleaved repeats after a warm-up round; "
                  f"commit {payload['commit']}, {payload['date']}; `{payload['command']}`; {env['cpu']}, "
                  f"{env['cores']} cores, torch {env['torch']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
