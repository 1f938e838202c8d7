"""Throughput under a production-like mix on equal cores: swiftserve's Serve app against diffusers in Serve.

Four systems, each a Ray Serve app on a local 2-CPU Ray cluster, deployed one at a time behind the same HTTP
front end (``ImagesIngress``: the OpenAI Images API, request validation and PNG answers), each on cores 0 and 1:

- ``vanilla``: diffusers as users serve it (``benchmarks.vanilla``): one replica on both cores (2 torch threads)
  holding the base pipeline and every ControlNet; a pipeline serves one call at a time, so
  ``max_ongoing_requests=1`` (the rest queue in Serve); each request's LoRAs are loaded from disk and fused
  before it, unfused and unloaded after it;
- ``strongest_vanilla``: two such replicas, one per core (1 torch thread each), every LoRA loaded as a PEFT
  adapter at its first use (the warm-up uses each) and picked per request with ``set_adapters`` (nothing fused),
  the ControlNet pipelines prebuilt;
- ``ours``: ``serving.app:build_app`` with its ``device_map``: a model replica on each core (its LoRA loads run in
  its process, so on its core too), the ControlNet services dealt over the cores (``cn0`` on core 0, ``cn1`` on
  core 1, ...), each shared by both model replicas; step-level batching and admission control as configured by
  default. (Until the layout changed, one model replica ran on core 0 and every ControlNet on core 1, which left
  core 1 idle whenever no ControlNet ran: ``benchmarks/results/bench_diffusion_more/``.)
- ``ours_cb_off``: the same with ``engine.continuous_batching: false``.

Every system gets the same seeded trace: ``--requests`` requests, each with 0-2 ControlNets (Zipf over
``--controlnets``, s=1.5) and 0-2 LoRAs (Zipf over ``--loras`` files, s=1.1), sent by an open-loop client at
Poisson arrival times of ``--rate`` per second. Without ``--rate`` the rate is ``--overload`` times the capacity of
``vanilla``, measured once before the first run on the trace's first requests: enough to saturate ours as well
unless it beats vanilla by more than that factor (a run of ours with no refusal says it may not have been
saturated). Each system is warmed up first (every ControlNet and LoRA used once, one request at a time). Repeats
are interleaved: ``for r in repeats: vanilla, strongest_vanilla, ours, ours_cb_off``.

Per run: successes (200 with an image), refusals (429/503: the server was overloaded), errors and timeouts, each
counted apart; throughput = successes / wall time (first scheduled send to last answer); p50 and p99 latency of
the successes from their scheduled send (from fewer than 100 the p99 is the maximum, and labelled so).
``engine_busy_fraction``: seconds the model replicas of ``ours`` spent computing denoising steps during the run,
time blocked on ControlNet services left out (their engine loops' ``busy_s``, read from each replica through
``DiffusionModel.engine_busy`` before and after; Ray's step-latency histogram will not do: it rebuilds sums from
bucket midpoints), over the run's wall time times the replicas. Every system is deployed as one application of a
Serve config, its replicas taking a hundredth of a Ray CPU each (pinning, not Ray, decides where they run), under
the malloc settings of ``serving.common.allocator``. Results:
``<--out>/bench_diffusion_throughput.{json,md}``.

    .venv/bin/python -m benchmarks.bench_diffusion_throughput [--preset sd15-shape] [--size 128] [--steps 4]
        [--requests 64] [--repeats 3] [--rate R | --overload 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray import serve

from autoconfig.workloads import Workload
from benchmarks.common import (
    CORES,
    Outcomes,
    conditioning_image,
    deploy_app,
    median_present,
    open_loop,
    poisson_offsets,
    ranges_overlap,
    serve_config_app,
    spread,
    tail,
    write_attention_lora,
)
from benchmarks.records import RESULTS, machine, provenance, write_results
from serving.common.allocator import REPLICA_RUNTIME_ENV
from serving.common.device import DTYPES
from serving.common.net import free_port
from serving.config import (
    ControlNetConfig,
    DeviceMap,
    DiffusionAppConfig,
    DiffusionModelConfig,
    EngineConfig,
    GenerationDefaults,
    LoRAConfig,
)
from serving.controlnet.conditioning import encode_image
from serving.engine import load_components
from serving.lora.format import LoRATargets
from serving.preset_catalog import PRESET_NAMES

NAME = "bench_diffusion_throughput"
SYSTEMS = ("vanilla", "strongest_vanilla", "ours", "ours_cb_off")
PATH = "/v1/images/generations"
PROMPT = "a red circle on a white background"
#: What every successful answer body holds (one base64 image per requested image).
IMAGE = b'"b64_json"'
#: Trace requests sent one at a time to ``vanilla`` to measure its capacity when no ``--rate`` is given.
CALIBRATION_REQUESTS = 4
#: Calls to read every model replica's busy seconds (Serve routes each call to one replica).
BUSY_READS = 200


# -- the trace ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRequest:
    """Which ControlNets and LoRAs (indices) one request names."""

    controlnets: tuple[int, ...]
    loras: tuple[int, ...]


def zipf_choice(rng: np.random.Generator, n: int, exponent: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    return int(rng.choice(n, p=weights / weights.sum()))


def request_mix(count: int, controlnets: int, loras: int, seed: int) -> list[TraceRequest]:
    """Per request 0-2 ControlNets (Zipf, s=1.5) and 0-2 LoRAs (Zipf, s=1.1), each count with p 0.3/0.5/0.2."""
    rng = np.random.default_rng(seed)
    trace = []
    for _ in range(count):
        nets = {zipf_choice(rng, controlnets, 1.5) for _ in range(int(rng.choice(3, p=[0.3, 0.5, 0.2])))}
        adapters = {zipf_choice(rng, loras, 1.1) for _ in range(int(rng.choice(3, p=[0.3, 0.5, 0.2])))}
        trace.append(TraceRequest(tuple(sorted(nets)), tuple(sorted(adapters))))
    return trace


def warm_up_requests(controlnets: int, loras: int) -> list[TraceRequest]:
    """Every ControlNet and every LoRA at least once, one ControlNet and two LoRAs per request."""
    count = max(controlnets, -(-loras // 2))
    return [TraceRequest((i % controlnets,), tuple(sorted({2 * i % loras, (2 * i + 1) % loras})))
            for i in range(count)]


def request_body(request: TraceRequest, seed: int, args: argparse.Namespace) -> bytes:
    """The OpenAI Images request for ``request``: its conditioning images inline as base64 PNG."""
    return json.dumps({
        "prompt": PROMPT, "size": f"{args.size}x{args.size}", "num_inference_steps": args.steps,
        "guidance_scale": 7.5, "seed": seed,
        "controlnets": [{"name": f"cn{i}", "image": encode_image(conditioning_image(args.size, i)),
                         "conditioning_scale": 1.0} for i in request.controlnets],
        "loras": [{"name": f"lora{i}", "scale": 0.8} for i in request.loras],
    }).encode()


def _workload(bodies: list[bytes]) -> Workload:
    return Workload("POST", PATH, bodies.__getitem__)


# -- the systems -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class System:
    """One contender: its Serve config application and where its replicas run (for the results)."""

    name: str
    description: str
    device_map: dict[str, list[list[int]]]
    app: dict[str, Any]


def app_config(args: argparse.Namespace, lora_dir: Path, *, continuous_batching: bool = True) -> DiffusionAppConfig:
    """Ours: a model replica on each core, the ControlNets dealt over the cores; seeded weights, as the baseline
    builds them."""
    source = {"preset": args.preset, "weights": "seeded", "device": args.device, "dtype": args.dtype}
    names = [f"cn{i}" for i in range(args.controlnets)]
    return DiffusionAppConfig(
        model=DiffusionModelConfig(name=args.preset, **source),
        defaults=GenerationDefaults(num_inference_steps=args.steps),
        engine=EngineConfig(continuous_batching=continuous_batching,
                            admission_wait_fraction=args.admission_wait_fraction),
        lora=LoRAConfig(directory=lora_dir),
        controlnets=[ControlNetConfig(name=name, seed=i, **source) for i, name in enumerate(names)],
        device_map=DeviceMap(model=CORES, controlnets={name: [CORES[i % len(CORES)]] for i, name in enumerate(names)}),
    )


def systems(args: argparse.Namespace, lora_dir: Path) -> list[System]:
    """The four contenders; ``vanilla`` on both cores in one replica, the others a replica per core."""
    config = app_config(args, lora_dir)
    ours_map = {"DiffusionModel": config.device_map.model,
                **{f"ControlNet_{name}": cores for name, cores in config.device_map.controlnets.items()}}
    models = [config.model_dump(mode="json", exclude_defaults=True)]

    def vanilla(name: str, cores: list[list[int]], adapters: bool) -> dict[str, Any]:
        return serve_config_app(name, "benchmarks.vanilla:build_vanilla_app",
                                {"models": models, "cores": cores, "adapters": adapters},
                                runtime_env=REPLICA_RUNTIME_ENV)

    def ours(name: str, continuous_batching: bool) -> dict[str, Any]:
        built = app_config(args, lora_dir, continuous_batching=continuous_batching)
        return serve_config_app(name, "serving.app:build_app", built.model_dump(mode="json", exclude_defaults=True),
                                {deployment: len(cores) for deployment, cores in ours_map.items()},
                                runtime_env=REPLICA_RUNTIME_ENV)

    return [
        System("vanilla", "diffusers, 1 replica x 2 cores, LoRAs loaded + fused per request",
               {"VanillaDiffusers": [[0, 1]]}, vanilla("vanilla", [[0, 1]], adapters=False)),
        System("strongest_vanilla", "diffusers, 2 replicas x 1 core, LoRAs kept loaded as adapters",
               {"VanillaDiffusers": CORES}, vanilla("strongest_vanilla", CORES, adapters=True)),
        System("ours", "swiftserve, continuous batching", ours_map, ours("ours", True)),
        System("ours_cb_off", "swiftserve, continuous batching off", ours_map, ours("ours_cb_off", False)),
    ]


# -- measuring ---------------------------------------------------------------------------------------------------

def one_at_a_time(url: str, bodies: list[bytes], timeout_s: float) -> list[float]:
    """Sends ``bodies`` one after another; their latencies. A system that fails one is broken: raises."""
    seconds = []
    for body in bodies:
        out = asyncio.run(open_loop(url, _workload([body]), [0.0], timeout_s=timeout_s, expect=IMAGE))
        if out.statuses != [200]:
            raise RuntimeError(f"a request sent alone got status {out.statuses[0]}")
        seconds += out.seconds
    return seconds


def engine_busy_s(app: str, replicas: int) -> float:
    """Seconds ``app``'s ``replicas`` model replicas have spent computing denoising steps since they started (not
    waiting on ControlNets), summed; each replica is asked until every one has answered (Serve picks the replica
    of a call)."""
    handle = serve.get_deployment_handle("DiffusionModel", app_name=app)
    busy: dict[int, float] = {}
    for _ in range(BUSY_READS):
        pid, seconds = handle.engine_busy.remote().result(timeout_s=60)
        busy[pid] = seconds
        if len(busy) == replicas:
            return sum(busy.values())
    raise RuntimeError(f"{app}: {len(busy)} of {replicas} model replicas answered {BUSY_READS} engine_busy calls")


def run_row(system: str, repeat: int, out: Outcomes) -> dict:
    """One run's figures: outcome counts, throughput, latency of the successes."""
    wall, ok, counts = out.wall_s(), out.ok_seconds(), out.counts()
    tail_s, tail_kind = tail(ok)
    return {
        "system": system, "repeat": repeat, "sent": len(out.statuses), **counts, "wall_s": wall,
        "throughput_per_min": 60 * counts["ok"] / wall,
        "p50_s": float(np.median(ok)) if len(ok) else None,
        "tail_s": tail_s, "tail": tail_kind, "send_lag_p99_ms": 1e3 * float(np.percentile(out.send_lag, 99)),
    }


def aggregate(rows: list[dict]) -> dict:
    """Per system: throughput median/min/max and every repeat, latency medians, outcome totals."""
    figures = {}
    for name in SYSTEMS:
        mine = [row for row in rows if row["system"] == name]
        if not mine:
            continue
        throughput = [row["throughput_per_min"] for row in mine]
        figures[name] = {
            "throughput_per_min": spread(throughput),
            "p50_s_median": median_present([row["p50_s"] for row in mine]),
            "tail_s_median": median_present([row["tail_s"] for row in mine]),
            "tail": "p99" if all(row["tail"] == "p99" for row in mine) else "max",
            **{key: sum(row[key] for row in mine) for key in ("sent", "ok", "refused", "errors", "timed_out")},
        }
        busy = [row["engine_busy_fraction"] for row in mine if "engine_busy_fraction" in row]
        if busy:
            figures[name]["engine_busy_fraction"] = {"median": statistics.median(busy), "min": min(busy),
                                                     "max": max(busy)}
    return figures


#: Summary key -> (numerator system, denominator system) of the throughput ratio.
RATIOS = {"ratio_vs_vanilla": ("ours", "vanilla"), "ratio_vs_strongest_vanilla": ("ours", "strongest_vanilla"),
          "ratio_cb_on_vs_off": ("ours", "ours_cb_off")}


def summarize(figures: dict) -> tuple[dict, dict]:
    """The issue's summary (ratios of median throughputs, ours' median busy fraction) and which ratios are ties."""
    summary, ties = {}, {}
    for key, (top, bottom) in RATIOS.items():
        a, b = figures[top]["throughput_per_min"], figures[bottom]["throughput_per_min"]
        summary[key] = a["median"] / b["median"] if b["median"] else None
        ties[key] = ranges_overlap(a["repeats"], b["repeats"])
    summary["engine_busy_fraction"] = figures["ours"]["engine_busy_fraction"]["median"]
    return summary, ties


# -- main --------------------------------------------------------------------------------------------------------

def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sd15-shape", choices=PRESET_NAMES)
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every system")
    parser.add_argument("--controlnets", type=int, default=3, help="ControlNets served")
    parser.add_argument("--loras", type=int, default=8, help="LoRA files served")
    parser.add_argument("--rank", type=int, default=64, help="rank of the LoRA files")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second; default: --overload x "
                                                                 "vanilla's capacity, measured before the first run")
    parser.add_argument("--overload", type=float, default=3.0, help="arrival rate over vanilla's capacity")
    parser.add_argument("--admission-wait-fraction", type=lambda text: None if text == "none" else float(text),
                        default=EngineConfig().admission_wait_fraction,
                        help="ours' engine.admission_wait_fraction ('none': no admission control)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="client timeout of one request")
    parser.add_argument("--device", default="auto", help="torch device of every model")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0, help="seed of the trace and its arrival times")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    started = time.monotonic()
    trace = request_mix(args.requests, args.controlnets, args.loras, args.seed)
    bodies = [request_body(request, seed, args) for seed, request in enumerate(trace)]
    warm = [request_body(request, seed, args)
            for seed, request in enumerate(warm_up_requests(args.controlnets, args.loras))]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        lora_dir = Path(tmp)
        components = load_components(DiffusionModelConfig(preset=args.preset, weights="seeded"))
        targets = LoRATargets.from_modules(components.denoiser, components.text_encoder, components.text_encoder_2)
        del components
        lora_bytes = [write_attention_lora(lora_dir / f"lora{i}.safetensors", targets, rank=args.rank, seed=i)
                      for i in range(args.loras)]
        contenders = systems(args, lora_dir)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        rate, offsets = args.rate, None
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=2**30,
                 runtime_env=REPLICA_RUNTIME_ENV)  # every process of the job starts as ours' replicas do
        try:
            for repeat, system in itertools.product(range(args.repeats), contenders):
                phase = time.monotonic()
                deploy_app(system.app, port)
                deployed = time.monotonic()
                one_at_a_time(url, warm, args.timeout_s)
                if rate is None:
                    service = one_at_a_time(url, bodies[:CALIBRATION_REQUESTS], args.timeout_s)
                    rate = args.overload / statistics.fmean(service)
                    print(f"{system.name}: {statistics.fmean(service):.2f} s per request alone; "
                          f"arrival rate {rate:.3f}/s", flush=True)
                if offsets is None:
                    offsets = poisson_offsets(rate, args.seed, count=args.requests)
                ours = system.name.startswith("ours")
                replicas = len(system.device_map.get("DiffusionModel", []))
                before = engine_busy_s(system.name, replicas) if ours else 0.0
                warmed = time.monotonic()
                out = asyncio.run(open_loop(url, _workload(bodies), offsets, timeout_s=args.timeout_s, expect=IMAGE))
                row = run_row(system.name, repeat, out)
                if ours:
                    row["step_s"] = engine_busy_s(system.name, replicas) - before
                    row["engine_busy_fraction"] = row["step_s"] / (replicas * row["wall_s"])
                serve.delete(system.name)
                row["phase_s"] = {"deploy": deployed - phase, "warm_up": warmed - deployed,
                                  "run": row["wall_s"], "total": time.monotonic() - phase}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()

    figures = aggregate(rows)
    summary, ties = summarize(figures)
    payload = {
        **provenance(), "machine": machine(), "args": vars(args),
        "device_map": {system.name: system.device_map for system in contenders},
        "systems": {system.name: system.description for system in contenders},
        "rate_per_s": rate, "rate_source": "--rate" if args.rate is not None else
        f"--overload {args.overload:g} x vanilla's capacity ({CALIBRATION_REQUESTS} trace requests alone)",
        "trace": {"arrival_s": [float(offset) for offset in offsets],
                  "requests": [{"controlnets": list(r.controlnets), "loras": list(r.loras)} for r in trace]},
        "lora_file_bytes": lora_bytes, "duration_s": time.monotonic() - started,
        "rows": rows, "figures": figures, "summary": summary, "summary_ranges_overlap": ties,
    }
    table = render(args, payload)
    print(table)
    write_results(NAME, payload, table, args.out)


def render(args: argparse.Namespace, payload: dict) -> str:
    figures, summary, ties = payload["figures"], payload["summary"], payload["summary_ranges_overlap"]
    counts = {key: sum(row[key] for row in payload["rows"]) for key in ("refused", "errors", "timed_out")}
    mix = payload["trace"]["requests"]
    lines = [
        f"# Throughput, Zipf mix of ControlNets and LoRAs: {args.preset} {args.size}x{args.size}, {args.steps} steps, "
        f"2 cores per system ({payload['machine']['device']}, {args.dtype})",
        "",
        f"{args.requests} requests per run ({sum(bool(r['controlnets']) for r in mix)} with ControlNets, "
        f"{sum(bool(r['loras']) for r in mix)} with LoRAs; {args.controlnets} ControlNets, {args.loras} LoRAs of "
        f"rank {args.rank}), Poisson arrivals at {payload['rate_per_s']:.3f}/s ({payload['rate_source']}), "
        f"{args.repeats} interleaved repeats. Every system is behind the same HTTP ingress. Latency from each "
        "request's scheduled send; the tail is the p99, or the max where a run had fewer than 100 successes.",
        "",
        "| system | cores | throughput req/min, median [min-max] | p50 s | tail s | ok | refused | errors | "
        "timed out | engine busy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, figure in figures.items():
        throughput = figure["throughput_per_min"]
        busy = figure.get("engine_busy_fraction")
        lines.append(
            f"| {name}: {payload['systems'][name]} | {_cores(payload['device_map'][name])} | "
            f"{throughput['median']:.2f} [{throughput['min']:.2f}-{throughput['max']:.2f}] | "
            f"{_fmt(figure['p50_s_median'])} | {_fmt(figure['tail_s_median'])} ({figure['tail']}) | "
            f"{figure['ok']} | {figure['refused']} | {figure['errors']} | {figure['timed_out']} | "
            f"{_fmt(busy and busy['median'])} |")
    lines += ["", "| summary | value | ranges overlap (tie) |", "|---|---|---|"]
    for key, value in summary.items():
        lines.append(f"| {key} | {_fmt(value)} | {'-' if key not in ties else ('yes' if ties[key] else 'no')} |")
    lines += ["", "Every run:", "",
              "| repeat | system | ok | refused | errors | timed out | wall s | req/min | p50 s | tail s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        lines.append(f"| {row['repeat']} | {row['system']} | {row['ok']} | {row['refused']} | {row['errors']} | "
                     f"{row['timed_out']} | {row['wall_s']:.1f} | {row['throughput_per_min']:.2f} | "
                     f"{_fmt(row['p50_s'])} | {_fmt(row['tail_s'])} ({row['tail']}) |")
    notes = []
    if any(counts.values()):
        notes.append(f"Across all runs: {counts['refused']} refusals, {counts['errors']} errors, "
                     f"{counts['timed_out']} timeouts; none counts as a success.")
    else:
        notes.append("No run had a refusal, an error or a timeout.")
    if not any(row["refused"] for row in payload["rows"] if row["system"] == "ours"):
        notes.append("`ours` refused nothing: it may not have been saturated, and its throughput may be the offered "
                     "rate rather than its capacity (raise `--overload`).")
    tied = [key for key, tie in ties.items() if tie]
    notes.append(f"Ratios whose throughput ranges overlap (ties): {', '.join(tied)}." if tied
                 else "No throughput ranges overlap.")
    notes.append("`engine_busy_fraction`: seconds ours' model replica spent computing denoising steps, waits on "
                 "ControlNet services left out (its engine loop's "
                 "`busy_s`) over the run's wall time, median of the runs.")
    return "\n".join([*lines, "", *notes])


def _cores(device_map: dict[str, list[list[int]]]) -> str:
    return "; ".join(f"{name} {' '.join(','.join(map(str, cores)) for cores in entries)}"
                     for name, entries in device_map.items())


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
