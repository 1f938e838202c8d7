"""What streaming partial images costs the engine (issue 24): throughput and latency with and without previews.

In-process, one model (``DiffusionEngine``, by default the ``tiny`` preset with its trained weights) served by
``LocalBackend`` the way a replica serves it, on one CPU core with one torch thread (``--core``: the process, so the
engine loop thread, its stage thread and the clients, is pinned there; one core = one device, as
``BENCHMARKING.md`` asks). ``--clients`` closed-loop clients each send their next request as soon as the last is
answered, ``--requests`` requests per run in all, under three arms:

- ``baseline``: ``partial_images=0`` through ``generate`` (no previews: the engine as a non-streaming client uses it);
- ``approx``:   ``partial_images=--partial-images`` through ``generate_stream``, previews decoded by the fitted linear
  latent->RGB map (``engine.preview_decoder: approx``, the default);
- ``vae``:      the same, previews decoded by the full VAE (``engine.preview_decoder: vae``).

Each arm has its own ``EngineLoop`` (the preview decoder is the loop's) over the one shared engine, so all three use
the same weights; only one loop has work at a time. Every arm is warmed up first (one request per client, not
counted); the approx map is fitted at the approx loop's first preview, during its warm-up. Its one-time cost is
timed apart, by fitting it directly before any warm-up (cold, as a replica's first preview pays it) and once more.
Then ``--repeats`` rounds run the arms interleaved (baseline approx vae, baseline approx vae, ...).

Per run: throughput (images of successful requests per second of wall time, first submission to last answer),
request latency p50 and tail (p99, or the max where a run had fewer than 100 successes), time from submission to
the first preview (streamed arms), previews received against what ``preview_steps`` promises (a request with
fewer is an error, never a success), refusals, errors and timeouts apart, and the engine loop's ``busy_s`` (seconds
in denoising steps) with the process CPU seconds: on one core, the stage thread's preview decodes show as denoising
steps that take longer and as lower throughput. ``summary``: per arm the median throughput and p99 (tail), and per
streamed arm its throughput over the baseline's (ratio of medians; the per-round ratios, each arm over the
baseline of its own round: median and min-max), a tie where those paired ratios fall on both sides of 1.
Results: ``<--out>/bench_streaming.{json,md}``.

    .venv/bin/python -m benchmarks.bench_streaming [--preset tiny] [--size 64] [--steps 20] [--n 1] [--clients 4]
        [--requests 200] [--partial-images 3] [--repeats 3] [--core 0] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import REFUSALS, median_present, ranges_overlap, spread, tail
from benchmarks.records import RESULTS, machine, provenance, write_results
from serving.common.device import pin_process
from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, DiffusionModelConfig, EngineConfig
from serving.engine import DiffusionEngine, GenerationParams, GenerationResult, LocalBackend, PartialImage
from serving.engine.preview import PreviewKind, preview_decoder, preview_steps
from serving.preset_catalog import PRESET_NAMES

NAME = "bench_streaming"
BASELINE = "baseline"
#: Prompts the tiny preset was trained on (the shapes world); request ``i`` uses prompt ``i % len`` and seed ``i``.
PROMPTS = ("a red circle on a white background", "a blue square on a yellow background",
           "a green triangle on a black background", "a yellow circle on a blue background")
OUTCOMES = ("ok", "refused", "errors", "timed_out", "short_previews")


@dataclass(frozen=True)
class Arm:
    """One way of serving the same requests: how many previews each asks for, and how they are decoded."""

    name: str
    partial_images: int
    preview: PreviewKind
    description: str

    @property
    def streamed(self) -> bool:
        return self.partial_images > 0


@dataclass
class Sample:
    """One request as its client saw it: outcome, seconds from submission to answer and to the first preview."""

    outcome: str
    latency_s: float
    first_preview_s: float | None = None
    previews: int = 0


@dataclass
class Run:
    """Every request of one run, and the run's wall time, engine busy seconds and process CPU seconds."""

    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    busy_s: float = 0.0
    cpu_s: float = 0.0


def arms(partial_images: int) -> list[Arm]:
    return [
        Arm(BASELINE, 0, "approx", "partial_images=0 through generate"),
        Arm("approx", partial_images, "approx", f"partial_images={partial_images} through generate_stream, "
                                                "fitted linear latent->RGB previews"),
        Arm("vae", partial_images, "vae", f"partial_images={partial_images} through generate_stream, "
                                          "full VAE decode per preview"),
    ]


# -- serving -----------------------------------------------------------------------------------------------------

def app_config(args: argparse.Namespace, preview: PreviewKind = "approx") -> DiffusionAppConfig:
    """The served configuration: the server's defaults but for the model, its threads and the preview decoder."""
    threads = None if args.core is not None else args.threads  # pinned: one torch thread per pinned core
    model = DiffusionModelConfig(preset=args.preset, weights=args.weights, device=args.device, torch_threads=threads)
    return DiffusionAppConfig(model=model, engine=EngineConfig(preview_decoder=preview))


def backends(engine: DiffusionEngine, args: argparse.Namespace, contenders: Sequence[Arm]) -> dict[str, LocalBackend]:
    """One backend (its own engine loop and stage thread) per arm, all over ``engine``."""
    return {arm.name: LocalBackend.for_engine(engine, app_config(args, arm.preview)) for arm in contenders}


def request(args: argparse.Namespace, arm: Arm, index: int) -> GenerationParams:
    return GenerationParams(prompt=PROMPTS[index % len(PROMPTS)], width=args.size, height=args.size,
                            num_inference_steps=args.steps, guidance_scale=args.guidance, seed=index, n=args.n,
                            partial_images=arm.partial_images)


def expected_previews(params: GenerationParams) -> int:
    """What ``preview_steps`` promises a request: its previews per image, times its images."""
    return len(preview_steps(params.num_inference_steps, params.partial_images)) * params.n


def time_approx_fit(engine: DiffusionEngine) -> float:
    """Seconds to fit the approx preview map on ``engine``'s VAE (what a loop's first approx preview pays)."""
    started = time.perf_counter()
    preview_decoder("approx", engine.vae, engine.vae_scale_factor, engine.vae_dtype)
    return time.perf_counter() - started


# -- load --------------------------------------------------------------------------------------------------------

async def one_request(backend: LocalBackend, params: GenerationParams, timeout_s: float) -> Sample:
    """Sends ``params`` (streamed when it asks for previews) and classifies what came back."""
    submitted = time.perf_counter()
    first: list[float] = []
    previews = 0

    async def call() -> GenerationResult:
        nonlocal previews
        if not params.partial_images:
            return await backend.generate(params)
        result = None
        async for event in backend.generate_stream(params):
            if isinstance(event, PartialImage):
                previews += 1
                if not first:
                    first.append(time.perf_counter() - submitted)
            else:
                result = event
        if result is None:
            raise RuntimeError("the stream ended without its result")
        return result

    try:
        result = await asyncio.wait_for(call(), timeout_s)
        outcome = "ok" if len(result.images) == params.n else "errors"
        if outcome == "ok" and previews < expected_previews(params):
            outcome = "short_previews"
    except asyncio.TimeoutError:
        outcome = "timed_out"
    except APIError as error:
        outcome = "refused" if error.status_code in REFUSALS else "errors"
    except Exception:  # a failed request is counted, never a success; the run goes on
        outcome = "errors"
    return Sample(outcome, time.perf_counter() - submitted, first[0] if first else None, previews)


async def closed_loop(backend: LocalBackend, params: Sequence[GenerationParams], clients: int,
                      timeout_s: float) -> Run:
    """``clients`` callers, each sending the next of ``params`` as soon as its last is answered."""
    run, pending = Run(), list(reversed(params))

    async def caller() -> None:
        while pending:
            run.samples.append(await one_request(backend, pending.pop(), timeout_s))

    loop = backend.loop
    busy, cpu, started = loop.busy_s, time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    run.wall_s, run.busy_s, run.cpu_s = time.perf_counter() - started, loop.busy_s - busy, time.process_time() - cpu
    return run


def measure(backend: LocalBackend, args: argparse.Namespace, arm: Arm, first_index: int, count: int) -> Run:
    params = [request(args, arm, first_index + i) for i in range(count)]
    return asyncio.run(closed_loop(backend, params, args.clients, args.timeout_s))


# -- figures -----------------------------------------------------------------------------------------------------

def run_row(arm: Arm, repeat: int, run: Run, args: argparse.Namespace) -> dict:
    """One run's figures (``repeat`` -1: the warm-up)."""
    ok = [s for s in run.samples if s.outcome == "ok"]
    latency = [s.latency_s for s in ok]
    first = [s.first_preview_s for s in ok if s.first_preview_s is not None]
    latency_tail, latency_kind = tail(latency)
    first_tail, first_kind = tail(first)
    images = len(ok) * args.n
    per_request = expected_previews(request(args, arm, 0))
    return {
        "arm": arm.name, "repeat": repeat, "sent": len(run.samples),
        **{outcome: sum(s.outcome == outcome for s in run.samples) for outcome in OUTCOMES},
        "images": images, "wall_s": run.wall_s, "images_per_s": images / run.wall_s if run.wall_s else 0.0,
        "p50_s": float(np.median(latency)) if latency else None, "tail_s": latency_tail, "tail": latency_kind,
        "first_preview_p50_s": float(np.median(first)) if first else None,
        "first_preview_tail_s": first_tail, "first_preview_tail": first_kind,
        "previews_received": sum(s.previews for s in run.samples),
        "previews_expected": per_request * len(run.samples),
        "busy_s": run.busy_s, "busy_fraction": run.busy_s / run.wall_s if run.wall_s else None,
        "busy_s_per_image": run.busy_s / images if images else None,
        "cpu_s": run.cpu_s, "cpu_s_per_image": run.cpu_s / images if images else None,
        "latency_s": [round(s.latency_s, 5) for s in ok],  # the raw samples, successes in answer order
        "first_preview_s": [round(seconds, 5) for seconds in first],
    }


def aggregate(rows: list[dict], contenders: Sequence[Arm]) -> dict:
    """Per arm: throughput median/min/max and every repeat, medians of the per-run latencies and engine figures,
    outcome totals."""
    figures = {}
    for arm in contenders:
        mine = [row for row in rows if row["arm"] == arm.name]
        throughput = [row["images_per_s"] for row in mine]
        figures[arm.name] = {
            "images_per_s": spread(throughput),
            "tail": "p99" if all(row["tail"] == "p99" for row in mine) else "max",
            **{f"{key}_median": median_present([row[key] for row in mine])
               for key in ("p50_s", "tail_s", "first_preview_p50_s", "first_preview_tail_s", "busy_s",
                           "busy_fraction", "busy_s_per_image", "cpu_s_per_image")},
            **{key: sum(row[key] for row in mine)
               for key in ("sent", *OUTCOMES, "previews_received", "previews_expected")},
        }
    return figures


def summarize(rows: list[dict], figures: dict, contenders: Sequence[Arm], fit_s: float) -> dict:
    """The issue's figures: per arm median throughput and tail; per streamed arm its throughput ratio over the
    baseline (ratio of medians; the per-round ratios, each over the baseline of its own round: their median and
    min-max), a tie where the per-round ratios fall on both sides of 1 (without rounds: where the throughput ranges
    overlap); the approx map's one-time fit; and a verdict."""
    summary: dict[str, float | str | None] = {}
    for arm in contenders:
        summary[f"{arm.name}_images_per_s"] = figures[arm.name]["images_per_s"]["median"]
        summary[f"{arm.name}_{figures[arm.name]['tail']}_s"] = figures[arm.name]["tail_s_median"]  # p99 or max
    base = figures[BASELINE]["images_per_s"]
    base_by_round = {row["repeat"]: row["images_per_s"] for row in rows if row["arm"] == BASELINE}
    verdicts = []
    for arm in (arm for arm in contenders if arm.streamed):
        mine = figures[arm.name]["images_per_s"]
        rounds = [row["images_per_s"] / base_by_round[row["repeat"]]
                  for row in rows if row["arm"] == arm.name and base_by_round.get(row["repeat"])]
        ratio = mine["median"] / base["median"] if base["median"] else None
        tie = (min(rounds) <= 1.0 <= max(rounds)) if rounds else ranges_overlap(mine["repeats"], base["repeats"])
        summary |= {f"throughput_ratio_{arm.name}": ratio,
                    f"throughput_ratio_{arm.name}_paired_median": statistics.median(rounds) if rounds else None,
                    f"throughput_ratio_{arm.name}_min": min(rounds, default=None),
                    f"throughput_ratio_{arm.name}_max": max(rounds, default=None),
                    f"throughput_tie_{arm.name}": float(tie)}
        verdicts.append(_verdict(arm.name, ratio, tie))
    summary["approx_fit_s"] = fit_s
    failed = sum(figures[arm.name][key] for arm in contenders for key in OUTCOMES if key != "ok")
    if failed:
        verdicts.append(f"{failed} request(s) refused, failed, timed out or short of previews: none counted as "
                        "a success")
    summary["verdict"] = "; ".join(verdicts) + "."
    return summary


def _verdict(name: str, ratio: float | None, tie: bool) -> str:
    if ratio is None:
        return f"{name}: no baseline throughput to compare with"
    if tie:
        return f"{name} previews: a tie with the baseline ({ratio:.3f}x; the paired rounds fall on both sides of 1)"
    return f"{name} previews: {ratio:.3f}x the baseline's throughput ({'faster' if ratio > 1 else 'a cost'})"


# -- output ------------------------------------------------------------------------------------------------------

def render(args: argparse.Namespace, payload: dict) -> str:
    figures, summary = payload["figures"], payload["summary"]
    lines = [
        f"# Streaming previews: {args.preset} ({args.weights} weights) {args.size}x{args.size}, {args.steps} steps, "
        f"n={args.n}, guidance {args.guidance:g}, {args.partial_images} previews per image "
        f"({payload['machine']['device']}, {payload['placement']})",
        "",
        f"{args.clients} closed-loop clients, {args.requests} requests per run, {args.repeats} interleaved rounds "
        "after one warm-up run per arm. Throughput: images of successful requests per wall second, median "
        "[min-max]; latencies: medians of the runs' figures; the tail is the p99, or the max where a run had fewer "
        "than 100 successes. Busy: the engine loop's seconds in denoising steps over wall time.",
        "",
        "| arm | images/s | p50 s | tail s | first preview p50 s | previews got/promised | busy | busy s/img | "
        "CPU s/img | ok | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, figure in figures.items():
        throughput = figure["images_per_s"]
        failed = sum(figure[key] for key in OUTCOMES if key != "ok")
        lines.append(
            f"| {name} | {throughput['median']:.3f} [{throughput['min']:.3f}-{throughput['max']:.3f}] | "
            f"{_fmt(figure['p50_s_median'])} | {_fmt(figure['tail_s_median'])} ({figure['tail']}) | "
            f"{_fmt(figure['first_preview_p50_s_median'])} | "
            f"{figure['previews_received']}/{figure['previews_expected']} | {_fmt(figure['busy_fraction_median'])} | "
            f"{_fmt(figure['busy_s_per_image_median'], 4)} | {_fmt(figure['cpu_s_per_image_median'], 4)} | "
            f"{figure['ok']} | {failed} |")
    lines += ["", "| summary | value |", "|---|---|"]
    lines += [f"| {key} | {value if isinstance(value, str) else _fmt(value, 4)} |" for key, value in summary.items()]
    lines += ["", f"Approx map fit (one-time, per engine loop): {_fmt(payload['approx_fit_s']['first'], 3)} s "
                  f"cold, {_fmt(payload['approx_fit_s']['again'], 3)} s again."]
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _progress(row: dict) -> str:
    label = "warm-up" if row["repeat"] < 0 else f"round {row['repeat'] + 1}"
    first = f", first preview p50 {row['first_preview_p50_s']:.3f} s" if row["first_preview_p50_s"] else ""
    failed = sum(row[key] for key in OUTCOMES if key != "ok")
    return (f"  [{label}] {row['arm']:<8} {row['images_per_s']:7.3f} img/s, p50 {_fmt(row['p50_s'], 3)} s, "
            f"{row['tail']} {_fmt(row['tail_s'], 3)} s{first}, previews {row['previews_received']}/"
            f"{row['previews_expected']}, busy {row['busy_s']:.1f}/{row['wall_s']:.1f} s, {failed} failed")


# -- main --------------------------------------------------------------------------------------------------------

def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    parser.add_argument("--weights", default="auto", choices=("auto", "seeded"),
                        help="the preset's shipped trained weights where it has some (auto), or seeded ones")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--n", type=int, default=1, help="images per request")
    parser.add_argument("--guidance", type=float, default=7.5, help="guidance scale (above 1: CFG, two rows)")
    parser.add_argument("--partial-images", type=int, default=3, help="previews per image in the streamed arms")
    parser.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    parser.add_argument("--requests", type=int, default=200, help="requests per run (all clients together)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every arm")
    parser.add_argument("--core", type=lambda text: None if text == "none" else int(text), default=0,
                        help="CPU core the whole process is pinned to, one torch thread ('none': not pinned, "
                             "--threads torch threads); ignored on CUDA")
    parser.add_argument("--threads", type=int, default=1, help="torch threads when not pinned")
    parser.add_argument("--device", default="auto", help="torch device of the model")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="client timeout of one request")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")
    args = parser.parse_args()
    if args.partial_images < 1:
        parser.error("--partial-images must be at least 1 (the baseline arm is the one without previews)")
    return args


def main() -> None:
    args = _arguments()
    started = time.monotonic()
    config = app_config(args)
    on_cuda = config.model.device.startswith("cuda") or (config.model.device == "auto" and torch.cuda.is_available())
    if args.core is not None and not on_cuda:
        pin_process([args.core])  # every thread from here on (loops, stage threads) starts on this core
    placement = "unpinned" if args.core is None or on_cuda else f"pinned to core {args.core}"
    engine = DiffusionEngine.from_config(config.model, config.lora)
    fit_s = {"first": time_approx_fit(engine), "again": time_approx_fit(engine)}
    contenders = arms(args.partial_images)
    served = backends(engine, args, contenders)
    print(f"{args.preset} {args.size}x{args.size}, {args.steps} steps, n={args.n}, {torch.get_num_threads()} torch "
          f"thread(s), {placement}; approx fit {fit_s['first']:.3f} s cold, {fit_s['again']:.3f} s again", flush=True)
    rows: list[dict] = []
    warm_up: list[dict] = []
    index = 0  # request indices (seeds, prompts) never repeat across runs
    try:
        for arm in contenders:
            run = measure(served[arm.name], args, arm, index, args.clients)
            index += args.clients
            warm_up.append(run_row(arm, -1, run, args))
            print(_progress(warm_up[-1]), flush=True)
        for repeat in range(args.repeats):
            for arm in contenders:
                run = measure(served[arm.name], args, arm, index, args.requests)
                index += args.requests
                rows.append(run_row(arm, repeat, run, args))
                print(_progress(rows[-1]), flush=True)
    finally:
        for backend in served.values():
            backend.close()

    figures = aggregate(rows, contenders)
    payload = {
        **provenance(), "machine": machine(), "placement": placement,
        "device_map": {"engine (loop, stage thread, clients)": [[args.core]] if placement != "unpinned" else None},
        "args": vars(args),
        "arms": {arm.name: arm.description for arm in contenders},
        "approx_fit_s": fit_s, "duration_s": time.monotonic() - started,
        "warm_up": warm_up, "rows": rows, "figures": figures,
        "summary": summarize(rows, figures, contenders, fit_s["first"]),
    }
    table = render(args, payload)
    print(table)
    write_results(NAME, payload, table, args.out)


if __name__ == "__main__":
    main()
