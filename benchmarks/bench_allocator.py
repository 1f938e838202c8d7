"""Which glibc malloc settings ``bench_diffusion`` runs under, measured: each setting in a child process of its own
(glibc reads them at process start), one core = one device as ``bench_diffusion`` has it.

- **band decode**: the preset's VAE decode at ``--size``, whole on core 0, then in two bands on core 0 and core 1 at
  once (``serving.engine.band_decode``: parallel CFG's decode, two devices' threads in one process); the fastest of
  ``--repeats`` and the minor page faults per decode.
- **denoiser split**: the preset's UNet (SD 1.x shape) on a CFG batch of two rows on core 0, then one row on each
  core at once (parallel CFG's split of the denoising); the fastest of ``--repeats`` and the page faults per run.
- **freed elsewhere**: each of ``--rounds`` rounds a new thread makes ``--probe-mib`` MiB of weight-sized tensors
  (6.5 MB, an SDXL attention projection) and the main thread frees them, as merged LoRA copies and diffusers' fused
  deltas are made and freed on different threads; the resident memory after each round's free.

Settings: glibc's ``default``; ``one_arena``, the one arena ``bench_diffusion`` ran under before; ``mmap_4mib``, the
fixed 4 MiB mmap threshold before that; ``tuned``, the settings every swiftserve replica (and ``bench_diffusion``)
starts with (``serving.common.allocator.TUNED_MALLOC_ENV``).

    python -m benchmarks.bench_allocator [--preset sd15-shape] [--size 256] [--probe-mib 1900]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch
from diffusers import UNet2DConditionModel

from benchmarks.common import to_core_1
from benchmarks.records import REPO, RESULTS, machine, provenance, timed, write_results
from serving.common.allocator import TUNED_MALLOC_ENV

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "one_arena": {"MALLOC_ARENA_MAX": "1"},
    "mmap_4mib": {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**20)},
    "tuned": TUNED_MALLOC_ENV,
}
_MALLOC_PREFIX = "MALLOC_"
_PROBE_TENSOR_FLOATS = 1280 * 1280  # 6.5 MB of float32


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sd15-shape")
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=3, help="runs timed per case (the fastest is kept)")
    parser.add_argument("--probe-mib", type=int, default=1900, help="MiB made and freed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    parser.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size % 8 or args.size < 16:
        parser.error("--size must be a multiple of 8, at least 16")
    if args.repeats < 1 or args.rounds < 1 or args.probe_mib < 1:
        parser.error("--repeats, --rounds and --probe-mib must be at least 1")
    return args


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _resident_gib() -> float:
    return psutil.Process().memory_info().rss / 2**30


def _fastest(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The fastest of ``repeats`` calls of ``run`` in seconds, and the minor page faults per call."""
    faults = _minor_faults()
    seconds = timed(run, repeats)
    return min(seconds), (_minor_faults() - faults) / repeats


@torch.inference_mode()
def band_decode(preset: str, size: int, repeats: int) -> dict[str, float]:
    from serving.engine.band_decode import BOTTOM, GeneratorBandPeer, decode_band, decode_with_peer
    from serving.presets import build_preset

    vae = build_preset(preset).vae.eval()
    latents = torch.randn(1, vae.config.latent_channels, size // 8, size // 8,
                          generator=torch.Generator().manual_seed(0))
    with ThreadPoolExecutor(max_workers=1, initializer=to_core_1, thread_name_prefix="core-1") as core_1:
        def banded() -> torch.Tensor:
            peer = GeneratorBandPeer(decode_band(vae, latents, BOTTOM), core_1, latents.device)
            return decode_with_peer(vae, latents, peer)

        def whole() -> torch.Tensor:
            return vae.decode(latents, return_dict=False)[0]

        banded(), whole()  # warm-up: the pool's thread, first-call costs
        whole_s, whole_faults = _fastest(whole, repeats)
        banded_s, banded_faults = _fastest(banded, repeats)
    return {"whole_s": whole_s, "banded_s": banded_s, "banded_over_whole": banded_s / whole_s,
            "whole_faults": whole_faults, "banded_faults": banded_faults}


@torch.inference_mode()
def denoiser_split(preset: str, size: int, repeats: int) -> dict[str, float]:
    """The preset's UNet forward of a CFG batch (two rows) on core 0, then one row on each core at once (parallel
    CFG's split): the fastest of ``repeats`` of each, the split's slower core."""
    from serving.presets import build_preset

    unet = build_preset(preset).denoiser.eval()
    if not isinstance(unet, UNet2DConditionModel) or unet.config.addition_embed_type is not None:
        raise SystemExit(f"bench_allocator: {preset}'s denoiser is not a UNet without added inputs (SD 1.x shape)")
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, unet.config.in_channels, size // 8, size // 8, generator=generator)
    context = torch.randn(2, 77, unet.config.cross_attention_dim, generator=generator)
    timestep = torch.tensor([500, 500])

    def rows(index: slice) -> Callable[[], object]:
        return lambda: unet(sample[index], timestep[index], encoder_hidden_states=context[index], return_dict=False)

    with ThreadPoolExecutor(max_workers=1, initializer=to_core_1, thread_name_prefix="core-1") as core_1:
        def split() -> None:
            other = core_1.submit(rows(slice(1, 2)))
            rows(slice(0, 1))()
            other.result()

        split(), rows(slice(0, 2))()  # warm-up
        batch_s, batch_faults = _fastest(rows(slice(0, 2)), repeats)
        split_s, split_faults = _fastest(split, repeats)
    return {"cfg_batch_s": batch_s, "split_s": split_s, "split_over_batch": split_s / batch_s,
            "batch_faults": batch_faults, "split_faults": split_faults}


def freed_elsewhere(probe_mib: int, rounds: int) -> dict[str, float | list[float]]:
    """Resident GiB before the rounds and after each round's free (``probe_mib`` made on a new thread, freed on
    this one)."""
    count = max(1, probe_mib * 2**20 // (4 * _PROBE_TENSOR_FLOATS))

    def make(into: list[torch.Tensor]) -> None:
        into.extend(torch.ones(_PROBE_TENSOR_FLOATS) for _ in range(count))

    before, after = _resident_gib(), []
    for _ in range(rounds):
        made: list[torch.Tensor] = []
        maker = threading.Thread(target=make, args=(made,))
        maker.start()
        maker.join()
        made.clear()
        after.append(_resident_gib())
    return {"before": before, "after_rounds": after, "growth": after[-1] - before}


def _child(args: argparse.Namespace) -> None:
    from serving.common.device import pin_process

    pin_process([0])  # this thread and those started later, one torch thread
    result = {"band_decode": band_decode(args.preset, args.size, args.repeats),
              "denoiser_split": denoiser_split(args.preset, args.size, args.repeats),
              "resident_gib": freed_elsewhere(args.probe_mib, args.rounds)}
    print(json.dumps(result))


def _run_setting(name: str) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(_MALLOC_PREFIX)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_allocator", *sys.argv[1:], "--child", name],
                          cwd=REPO, env={**env, **SETTINGS[name]}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"setting {name} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = _options()
    if args.child is not None:
        _child(args)
        return
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_allocator: needs two cores (one per device)")
    settings = {name: {"env": env, **_run_setting(name)} for name, env in SETTINGS.items()}
    summary = {f"band_over_whole_{name}": result["band_decode"]["banded_over_whole"]
               for name, result in settings.items()}
    summary |= {f"denoiser_split_over_batch_{name}": result["denoiser_split"]["split_over_batch"]
                for name, result in settings.items()}
    summary |= {f"resident_growth_gib_{name}": result["resident_gib"]["growth"] for name, result in settings.items()}
    payload = {**provenance(), "machine": machine(), "args": vars(args), "settings": settings, "summary": summary}
    table = _table(args, payload)
    print(table)
    write_results("bench_allocator", payload, table, args.out)


def _table(args: argparse.Namespace, payload: dict) -> str:
    settings = payload["settings"]
    lines = [f"# glibc malloc settings: {args.preset} at {args.size} px on two cores, and blocks freed on another "
             "thread", "",
             f"Commit {payload['commit']}, {payload['date']}: `{payload['command']}`. One core = one device; each "
             f"setting in a process of its own; fastest of {args.repeats} (page faults: per run, mean).", "",
             "| setting | env | CFG batch, core 0 (s) | a row on each core (s) | split / batch | page faults batch "
             "| page faults split |",
             "|---|---|---|---|---|---|---|"]
    for name, result in settings.items():
        split = result["denoiser_split"]
        lines.append(f"| {name} | {_env_text(result['env'])} | {split['cfg_batch_s']:.3f} | {split['split_s']:.3f} | "
                     f"{split['split_over_batch']:.3f} | {split['batch_faults']:.0f} | {split['split_faults']:.0f} |")
    lines += ["", "| setting | whole VAE decode, core 0 (s) | two bands, both cores (s) | bands / whole | page faults "
              "whole | page faults bands | resident GiB before, then after each round | growth (GiB) |",
              "|---|---|---|---|---|---|---|---|"]
    for name, result in settings.items():
        decode, resident = result["band_decode"], result["resident_gib"]
        rounds = ", ".join(f"{gib:.2f}" for gib in [resident["before"], *resident["after_rounds"]])
        lines.append(f"| {name} | {decode['whole_s']:.3f} | {decode['banded_s']:.3f} | "
                     f"{decode['banded_over_whole']:.3f} | {decode['whole_faults']:.0f} | "
                     f"{decode['banded_faults']:.0f} | {rounds} | {resident['growth']:.2f} |")
    return "\n".join(lines)


def _env_text(env: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in env.items()) or "-"


if __name__ == "__main__":
    main()
