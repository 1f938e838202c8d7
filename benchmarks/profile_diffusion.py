"""Where one diffusion request's time goes, swiftserve's engine against diffusers' pipeline, set up as
``bench_diffusion`` sets them up (one core = one device, every thread pinned, one torch thread each):

- each case (ours plain and with parallel CFG, diffusers plain) runs once to warm up, once timed, and then sampled by
  ``py-spy record --threads`` (every thread) over as many runs as fill ``--min-sampled-seconds``: its wall time, its
  stages as the engine reports them, samples per thread and the frames with the most samples
  (``benchmarks/flames.py``);
- the denoiser's scaling over the two devices, from the inputs diffusers' pipeline gave it: one forward of the CFG
  batch (both branches) on device 0, one of a single branch, and one branch on each device at once, whole and per
  top-level block. A single branch on each device at once over both branches on one device is the most parallel
  CFG can save in its denoising on this machine;
- the machine's own scaling: what both cores busy at once leave each of its rate alone, on compute and on memory.

    .venv/bin/python -m benchmarks.profile_diffusion [--preset sd15-shape] [--size 256] [--steps 4] [--top 25]
        [--rate 100] [--min-sampled-seconds 2]

Results: ``<--out>/profiles/diffusion_<preset>.{json,md}`` and the collapsed stacks beside them
(``benchmarks/results/profiles/`` by default). Sampling slows a request a little; the timed runs and
``bench_diffusion``'s figures are the ones to quote.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.bench_diffusion import (
    ENGINE_LOOP_THREAD,
    OURS,
    THEIRS,
    Case,
    Devices,
    build_systems,
    command_line,
    run_case,
    under_allocator_env,
)
from benchmarks.common import module_sharing_weights, to_core_1
from benchmarks.flames import frame_totals, thread_samples
from benchmarks.records import machine, provenance, write_results
from serving.common.device import resolve_device
from serving.preset_catalog import PRESET_FAMILIES

CASES = ((OURS, "0c-0l"), (THEIRS, "0c-0l"), (OURS, "0c-0l parallel CFG"))
REQUIRED_THREADS = (ENGINE_LOOP_THREAD, "cfg-worker")  # the threads of the cases above that do device work
SCALING_REPEATS = 3
PY_SPY_ATTACH_S = 1.0  # py-spy's start before the sampled request


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--top", type=int, default=25, help="frames listed per case")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--min-sampled-seconds", type=float, default=2.0,
                        help="the sampled case repeats until it has run this long, so a short case still gets samples")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"))


def sampled(case: Case, py_spy: str, rate: int, min_seconds: float, stacks: Path, top: int) -> dict:
    """``case`` timed once, then run under ``py-spy record --threads`` (every thread of this process, idle ones left
    out) until ``min_seconds`` have passed: wall times, samples per thread and the frames with the most samples; the
    stacks go to ``stacks``."""
    timed = run_case(case)
    recorder = subprocess.Popen(
        [py_spy, "record", "--pid", str(os.getpid()), "--rate", str(rate), "--threads", "--nonblocking",
         "--format", "raw", "--output", str(stacks)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(PY_SPY_ATTACH_S)
        under = [run_case(case)]
        while sum(run["seconds"] for run in under) < min_seconds:
            under.append(run_case(case))
    finally:
        recorder.send_signal(signal.SIGINT)  # py-spy writes its stacks and exits
        _, error = recorder.communicate(timeout=120)
    if not stacks.exists():
        raise RuntimeError(f"py-spy wrote no stacks: {error.decode()[-500:]}")
    collapsed = stacks.read_text()
    total, inclusive, leaf = frame_totals(collapsed)
    return {
        "seconds": timed["seconds"],
        "timings": timed.get("timings"),
        "seconds_sampled": statistics.median(run["seconds"] for run in under),
        "runs_sampled": len(under),
        "samples": total,
        "samples_per_thread": dict(thread_samples(collapsed).most_common()),
        "top_frames": [{"frame": frame, "inclusive": count / total, "self": leaf[frame] / total}
                       for frame, count in inclusive.most_common(top)],
        "top_self": [{"frame": frame, "self": count / total} for frame, count in leaf.most_common(top)],
    }


def _capture_call(module: torch.nn.Module, run: Callable[[], object]) -> tuple[tuple, dict]:
    """The positional and keyword arguments of ``module``'s first forward while ``run`` runs."""
    calls: list[tuple[tuple, dict]] = []
    handle = module.register_forward_pre_hook(lambda _, args, kwargs: calls.append((args, kwargs)) if not calls
                                              else None, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return calls[0]


def _branch(value: object) -> object:
    """The first CFG branch of a captured argument: tensors of batch 2 (and those inside dicts) halved."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == 2:
        return value[:1].clone()
    if isinstance(value, dict):
        return {key: _branch(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_branch(item) for item in value)
    return value


class BlockTimes:
    """Seconds of each top-level block of a UNet (``conv_in``, ``down_blocks.<i>``, ``mid_block``, ``up_blocks.<i>``,
    the rest) in the forwards run while installed, summed over those forwards."""

    def __init__(self, unet: torch.nn.Module) -> None:
        self.unet = unet
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}
        self._handles: list = []

    def blocks(self) -> list[tuple[str, torch.nn.Module]]:
        named = []
        for name, child in self.unet.named_children():
            if isinstance(child, torch.nn.ModuleList):
                named += [(f"{name}.{index}", block) for index, block in enumerate(child)]
            else:
                named.append((name, child))
        return named

    def __enter__(self) -> BlockTimes:
        for name, block in self.blocks():
            self._handles.append(block.register_forward_pre_hook(
                lambda *_, name=name: self._started.__setitem__(name, time.perf_counter())))
            self._handles.append(block.register_forward_hook(lambda *_, name=name: self._stop(name)))
        return self

    def _stop(self, name: str) -> None:
        self.seconds[name] += time.perf_counter() - self._started.pop(name)

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()


def _forward_s(module: torch.nn.Module, args: tuple, kwargs: dict) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        module(*args, **kwargs)
    return time.perf_counter() - started


def denoiser_scaling(denoiser: torch.nn.Module, twin: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """Seconds of one forward, whole and per top-level block (``BlockTimes``): the CFG batch on core 0, one branch
    on core 0, and one branch on each core at once (``twin``, a module over the same weights, on core 1; the block
    times are core 0's); medians of ``SCALING_REPEATS``."""
    branch_args, branch_kwargs = _branch(args), _branch(kwargs)
    runs = {"cfg_batch_one_core": lambda: _forward_s(denoiser, args, kwargs),
            "one_branch_one_core": lambda: _forward_s(denoiser, branch_args, branch_kwargs),
            "one_branch_each_core_at_once": lambda: max(_on_each_core(
                lambda: _forward_s(denoiser, branch_args, branch_kwargs),
                lambda: _forward_s(twin, branch_args, branch_kwargs)))}
    seconds: dict[str, list[float]] = defaultdict(list)
    blocks: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(SCALING_REPEATS):
        for name, run in runs.items():
            with BlockTimes(denoiser) as times:
                seconds[name].append(run())
            blocks[name].append(dict(times.seconds))
    result: dict = {f"{name}_s": statistics.median(values) for name, values in seconds.items()}
    result["best_parallel_cfg_denoise_ratio"] = (result["one_branch_each_core_at_once_s"]
                                                 / result["cfg_batch_one_core_s"])
    result["blocks_s"] = {name: {block: statistics.median(run[block] for run in repeats) for block in repeats[0]}
                          for name, repeats in blocks.items()}
    return result


def _on_each_core(on_core_0: Callable[[], float], on_core_1: Callable[[], float]) -> tuple[float, float]:
    """``on_core_0`` on this thread (core 0) and ``on_core_1`` on a thread of its own on core 1, at once: their
    results."""
    other: list[float] = []

    def run_on_core_1() -> None:
        to_core_1()
        other.append(on_core_1())

    thread = threading.Thread(target=run_on_core_1, name="scaling-core-1")
    thread.start()
    mine = on_core_0()
    thread.join()
    return mine, other[0]


def _on_both_cores(work: Callable[[], float]) -> tuple[float, float]:
    """``work``'s rate on core 0 alone, then the lower of its rates on core 0 and core 1 at once."""
    return work(), min(_on_each_core(work, work))


def _rate(op: Callable[[], object], seconds: float = 1.0) -> float:
    """Calls of ``op`` per second over about ``seconds``."""
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        op()
        calls += 1
    return calls / elapsed


def _product_rate() -> float:
    # Compute-bound (blocked), and long enough (tens of ms) that waiting for the GIL between products is noise.
    square = torch.randn(1024, 1024)
    return _rate(lambda: square @ square)


def _copy_rate() -> float:
    big, into = torch.randn(2**26), torch.empty(2**26)  # 256 MiB each
    return _rate(lambda: into.copy_(big))


def machine_scaling() -> dict[str, float]:
    """What running on both cores at once leaves each core, as a fraction of its rate alone: a 1024 x 1024 matrix
    product (compute) and a 256 MiB copy (memory bandwidth), each thread on operands of its own."""
    compute, memory = _on_both_cores(_product_rate), _on_both_cores(_copy_rate)
    return {"compute_at_once_over_alone": compute[1] / compute[0], "memory_at_once_over_alone": memory[1] / memory[0]}


def main() -> None:
    under_allocator_env("benchmarks.profile_diffusion")
    args, params = command_line(__doc__, repeats=1, options=_options)
    if PRESET_FAMILIES[args.preset] == "flux":
        raise SystemExit("profile_diffusion: UNet presets only (Flux's true CFG runs its branches as two forwards)")
    device = resolve_device("auto")
    if device.type != "cpu":
        raise SystemExit("profile_diffusion: CPU only (one core = one device)")
    devices = Devices(device, torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        built = build_systems(args, params, device, torch.float32, Path(tmp))
        systems = {OURS: built.ours.cases, THEIRS: built.vanilla.cases}
        try:
            for system, case in CASES:
                run_case(systems[system][case])
            devices.place()
            devices.check(devices.snapshot(), REQUIRED_THREADS)
            out = args.out / "profiles"
            out.mkdir(parents=True, exist_ok=True)
            cases = {f"{system} {case}": sampled(systems[system][case], args.py_spy, args.rate,
                                                 args.min_sampled_seconds,
                                                 out / f"diffusion_{args.preset}-{system}-{case.replace(' ', '_')}.txt",
                                                 args.top)
                     for system, case in CASES}
            denoiser = built.vanilla.plain.unet
            captured = _capture_call(denoiser, lambda: run_case(systems[THEIRS]["0c-0l"]))
            scaling = denoiser_scaling(denoiser, module_sharing_weights(denoiser), *captured)
            cores = machine_scaling()
            devices.check(devices.snapshot(), REQUIRED_THREADS)
        finally:
            built.ours.close()
    payload = {**provenance(), "machine": machine(), "args": vars(args), "cases": cases, "denoiser_scaling": scaling,
               "core_scaling": cores}
    table = _table(args, payload)
    print(table)
    write_results(f"diffusion_{args.preset}", payload, table, out)


def _table(args: argparse.Namespace, payload: dict) -> str:
    scaling, cores = payload["denoiser_scaling"], payload["core_scaling"]
    lines = [
        f"# Where a request's time goes: {args.preset}, {args.size}x{args.size}, {args.steps} steps, CFG "
        f"(one core = one device)",
        "",
        f"Commit {payload['commit']}, {payload['date']}: `{payload['command']}`. Each case timed once, then sampled "
        f"by py-spy ({args.rate} Hz, every thread, idle ones left out; a frame's share counts the native work it "
        f"called) over as many runs as fill {args.min_sampled_seconds:g} s; the timed figures here and "
        "`bench_diffusion`'s are the ones to quote. Collapsed stacks beside this file.",
        "",
        "| case | seconds | stages (s) | seconds sampled (median) | runs sampled | samples per thread |",
        "|---|---|---|---|---|---|",
    ]
    for name, case in payload["cases"].items():
        stages = ", ".join(f"{key.removesuffix('_s')} {value:.2f}" for key, value in (case["timings"] or {}).items())
        threads = ", ".join(f"{count}" for count in list(case["samples_per_thread"].values())[:3])
        lines.append(f"| {name} | {case['seconds']:.2f} | {stages or '-'} | {case['seconds_sampled']:.2f} | "
                     f"{case['runs_sampled']} | {threads} |")
    lines += [
        "",
        "Denoiser scaling (one forward, median of 3): the CFG batch on one core "
        f"{scaling['cfg_batch_one_core_s']:.2f} s, one branch on one core {scaling['one_branch_one_core_s']:.2f} s, "
        f"one branch on each core at once {scaling['one_branch_each_core_at_once_s']:.2f} s: parallel CFG can at best "
        f"take {scaling['best_parallel_cfg_denoise_ratio']:.3f} of the batched denoising's time on this machine. "
        f"Both cores busy at once leave each {cores['compute_at_once_over_alone']:.2f} of its rate alone on a "
        f"1024 x 1024 matrix product and {cores['memory_at_once_over_alone']:.2f} on a 256 MiB copy.",
        "",
        "| block (core 0) | CFG batch, one core (s) | one branch, one core (s) | one branch, each core at once (s) | "
        "at once / alone |",
        "|---|---|---|---|---|",
    ]
    blocks = scaling["blocks_s"]
    for block, batch in blocks["cfg_batch_one_core"].items():
        alone, at_once = blocks["one_branch_one_core"][block], blocks["one_branch_each_core_at_once"][block]
        lines.append(f"| {block} | {batch:.3f} | {alone:.3f} | {at_once:.3f} | "
                     f"{at_once / alone if alone else float('nan'):.2f}x |")
    for name, case in payload["cases"].items():
        lines += ["", f"## {name} ({case['samples']} samples)", "", "| frame | inclusive | self |", "|---|---|---|"]
        lines += [f"| `{frame['frame']}` | {frame['inclusive']:.1%} | {frame['self']:.1%} |"
                  for frame in case["top_frames"]]
        lines += ["", "Most self time:", ""]
        lines += [f"- {frame['self']:.1%} `{frame['frame']}`" for frame in case["top_self"][:10]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
