"""Overload and soak: both applications of ``deploy/serve_config.yaml`` (what ``make serve`` runs) driven past
their capacity for minutes, against the same apps at capacity, in one run.

1. At capacity (the baseline): per app, a closed loop of as many clients as the app runs at once (the diffusion
   engine's batch: ``max_batch_rows`` / 2 guided images; the DLRM ingress's ``max_ongoing_requests``), for
   ``--capacity-s`` seconds: throughput and latency.
2. Overload soak: per app, open-loop Poisson arrivals at ``--overload`` times the throughput measured in 1, for
   ``--minutes``. Excess requests must come back 503 with ``Retry-After`` at once, admitted ones keep about the
   baseline latency, and every Serve process's RSS (replicas, proxy, controller) is sampled every ``--sample-s``
   seconds: it must stay flat.

Prints, per app, admitted p50/p99 under overload over p50/p99 at capacity (the ratio), refusal latency, how late
the client sent (a late client, not the app, would be what saturated), and each process's RSS at the start and end
of the soak with its slope; writes
``<--out>/bench_overload_<apps>.{json,md,png}`` (``benchmarks/results`` by default) (the PNG: RSS curves over the soak).

    .venv/bin/python -m benchmarks.bench_overload [--minutes 10] [--overload 3] [--apps diffusion] [--dlrm-rows 512]

On a small machine the load generator, Serve's proxy and the apps share the cores. So that the app saturates
first, the client is aiohttp (see ``_session``) and DLRM requests carry ``--dlrm-rows`` rows: at 16 rows the app
answers in milliseconds and the client would be the bottleneck. The committed runs drive one app each
(``--apps diffusion``, ``--apps dlrm``): soaked together, the apps share the cores and neither gets 3x its own
capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import numpy as np
import psutil
import ray
from ray import serve

from autoconfig.serve_config import deploy_serve_config, load_serve_config
from autoconfig.workloads import diffusion_workload, dlrm_workload
from benchmarks.common import Outcomes, closed_loop, open_loop, poisson_offsets
from benchmarks.records import RESULTS, machine, provenance, write_results
from disagg.config import DLRMAppConfig
from disagg.deployments.app import ingress_options
from serving.common.memory import serve_processes
from serving.common.net import free_port
from serving.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]
#: An open-loop request leaving later than this after its scheduled time means the client could not keep up.
LATE_CLIENT_MS = 100


class RSSSampler:
    """RSS of the Serve processes alive at the start, every ``period_s`` seconds."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.processes = serve_processes()
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._start = time.monotonic()
        self._next = 0.0

    def tick(self) -> None:
        now = time.monotonic() - self._start
        if now < self._next:
            return
        self._next = now + self.period_s
        rss = {}
        for name, process in self.processes.items():
            try:
                rss[name] = process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        self.samples.append((now, rss))

    def curves(self) -> dict[str, dict[str, float]]:
        """Per process: first, last, max RSS (MiB) and the least-squares slope (MiB per minute)."""
        result = {}
        for name in self.processes:
            points = [(t, rss[name]) for t, rss in self.samples if name in rss]
            if len(points) < 2:
                continue
            t, rss = np.array(points, dtype=float).T
            slope = float(np.polyfit(t / 60.0, rss / 2**20, 1)[0])
            result[name] = {"first_mib": rss[0] / 2**20, "last_mib": rss[-1] / 2**20, "max_mib": rss.max() / 2**20,
                            "slope_mib_per_min": slope}
        return result


def batch_requests(config, app: str) -> int:
    """Guided one-image requests (two UNet rows each) in one denoising step of ``app``'s engine (of its default
    model, the first, where it serves several: the workload names no model)."""
    application = next(entry for entry in config.applications if entry.name == app)
    args = application.args["models"][0] if "models" in application.args else application.args
    return EngineConfig.model_validate(args.get("engine", {})).max_batch_rows // 2


def dlrm_ingress_requests(config) -> int:
    """Requests the DLRM ingress holds at once (two batches, unless the Serve config says otherwise)."""
    application = next(entry for entry in config.applications if entry.name == "dlrm")
    configured = next((entry.max_ongoing_requests for entry in application.deployments or []
                       if entry.name in ("DisaggregatedDLRM", "MonolithicDLRM")
                       and "max_ongoing_requests" in entry.model_fields_set), None)
    return configured or ingress_options(DLRMAppConfig.model_validate(application.args))["max_ongoing_requests"]


def plot(sampler: RSSSampler, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5))
    for name in sampler.processes:
        points = [(t / 60.0, rss[name] / 2**20) for t, rss in sampler.samples if name in rss]
        if points:
            axis.plot(*zip(*points, strict=True), label=name.split("#")[0])
    axis.set(xlabel="minutes of overload", ylabel="RSS (MiB)", title="Serve processes' RSS during the overload soak")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the overload soak")
    parser.add_argument("--overload", type=float, default=3.0, help="offered rate over the measured capacity")
    parser.add_argument("--capacity-s", type=float, default=60.0, help="length of each at-capacity baseline")
    parser.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps of each diffusion request")
    parser.add_argument("--apps", default="diffusion,dlrm",
                        help="comma-separated apps to drive")
    parser.add_argument("--dlrm-rows", type=int, default=512,
                        help="rows of each DLRM request: enough that the app, not the client, saturates first")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")
    args = parser.parse_args()
    source = provenance()  # before this run writes its results into the tree

    config = load_serve_config(REPO / "deploy" / "serve_config.yaml")
    config.http_options.port = free_port()
    base = f"http://127.0.0.1:{config.http_options.port}"
    apps = {
        "diffusion": (base, diffusion_workload(size="64x64", steps=args.steps),
                      batch_requests(config, "diffusion")),
        "dlrm": (f"{base}/v2", dlrm_workload(rows_per_request=args.dlrm_rows), dlrm_ingress_requests(config)),
    }
    apps = {name: apps[name] for name in args.apps.split(",")}
    ray.init(num_cpus=args.cpus, include_dashboard=False, object_store_memory=512 * 2**20)
    try:
        deploy_serve_config(config, timeout_s=600)
        results = {name: {} for name in apps}
        for name, (url, workload, clients) in apps.items():
            asyncio.run(closed_loop(url, workload, clients, 10.0))  # warm-up
            outcomes = asyncio.run(closed_loop(url, workload, clients, args.capacity_s))
            results[name]["capacity"] = outcomes.summary(args.capacity_s) | {"clients": clients}
            print(name, "at capacity", results[name]["capacity"], flush=True)
        sampler = RSSSampler(args.sample_s)
        sampler.tick()
        duration = 60.0 * args.minutes

        async def soak() -> list[Outcomes]:
            return await asyncio.gather(*(
                open_loop(url, workload, poisson_offsets(args.overload * results[name]["capacity"]["ok_per_s"], seed,
                                                         duration_s=duration),
                          on_tick=sampler.tick if seed == 0 else None)
                for seed, (name, (url, workload, _)) in enumerate(apps.items())
            ))

        for name, outcomes in zip(apps, asyncio.run(soak()), strict=True):
            offered = args.overload * results[name]["capacity"]["ok_per_s"]
            results[name]["overload"] = outcomes.summary(duration) | {"offered_per_s": offered}
            print(name, "overloaded", results[name]["overload"], flush=True)
            if (results[name]["overload"]["send_lag_p99_ms"] or 0) > LATE_CLIENT_MS:
                print(f"WARNING: the client sent {name}'s requests late (p99 > {LATE_CLIENT_MS} ms after their "
                      "schedule): it, not the app, was saturated", flush=True)
        sampler.tick()
    finally:
        serve.shutdown()
        ray.shutdown()

    memory = sampler.curves()
    stem = "bench_overload_" + "_".join(apps)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(sampler, args.out / f"{stem}.png")
    lines = [f"# Overload soak: `make serve`'s apps at {args.overload:g}x capacity for {args.minutes:g} min "
             f"({machine()['device']}, {args.cpus} CPUs)", "",
             "| app | offered/s | ok/s | refused 503 (with Retry-After) | other | refusal p99 ms | "
             "admitted p50 ms (capacity -> overload, ratio) | admitted p99 ms (capacity -> overload, ratio) | "
             "client send lag p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        cap, over = result["capacity"], result["overload"]
        lines.append(
            f"| {name} | {over['offered_per_s']:.1f} | {over['ok_per_s']:.1f} | {over['refused_503']} "
            f"({over['refused_with_retry_after']}) | {over['other']} | {_fmt(over['refused_p99_ms'])} | "
            f"{_fmt(cap['ok_p50_ms'])} -> {_fmt(over['ok_p50_ms'])} ({_ratio(over['ok_p50_ms'], cap['ok_p50_ms'])}) | "
            f"{_fmt(cap['ok_p99_ms'])} -> {_fmt(over['ok_p99_ms'])} ({_ratio(over['ok_p99_ms'], cap['ok_p99_ms'])}) | "
            f"{_fmt(over['send_lag_p99_ms'])} |")
    lines += ["", "| process | RSS first MiB | last MiB | max MiB | slope MiB/min |", "|---|---|---|---|---|"]
    for name, curve in sorted(memory.items()):
        lines.append(f"| {name.split('#')[0]} | {curve['first_mib']:.0f} | {curve['last_mib']:.0f} | "
                     f"{curve['max_mib']:.0f} | {curve['slope_mib_per_min']:+.2f} |")
    summary = overload_summary(results, memory)
    lines += ["", "Summary: " + ", ".join(f"`{key}` {value:.3g}" for key, value in summary.items()) + ". "
              f"Commit `{source['commit']}`, {source['date']}: `{source['command']}`."]
    table = "\n".join(lines)
    print(table)
    write_results(stem, {**source, "machine": machine(), "args": vars(args),
                         "summary": summary, "apps": results, "rss": memory, "samples": sampler.samples},
                  table, args.out)


def overload_summary(results: dict[str, dict], memory: dict[str, dict]) -> dict[str, float]:
    """Per app under overload: answers per second over the capacity measured before, the share of requests
    refused (503), admitted p99 over its p99 at capacity; the steepest RSS slope of any process (MiB/min)."""
    summary: dict[str, float] = {}
    for name, result in results.items():
        cap, over = result["capacity"], result["overload"]
        summary[f"{name}_ok_over_capacity"] = over["ok_per_s"] / cap["ok_per_s"]
        summary[f"{name}_refused_share"] = over["refused_503"] / over["sent"] if over["sent"] else 0.0
        if cap["ok_p99_ms"] and over["ok_p99_ms"] is not None:
            summary[f"{name}_admitted_p99_ratio"] = over["ok_p99_ms"] / cap["ok_p99_ms"]
    summary["max_rss_slope_mib_per_min"] = max((curve["slope_mib_per_min"] for curve in memory.values()),
                                               default=0.0)
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(value: float | None, baseline: float | None) -> str:
    return "-" if value is None or not baseline else f"{value / baseline:.2f}x"


if __name__ == "__main__":
    main()
