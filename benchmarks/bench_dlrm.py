"""Disaggregated DLRM serving against the monolithic baseline: same cores, scale-out memory, cache, dense memory.

Sections (``--sections``, default all), every system deployed as a Serve app of ``disagg.app:build_app`` in one
Ray cluster on this machine, requests sent through the ingress handles (``infer``; both sides skip HTTP alike):

- ``same_cores``: monolithic (one replica of ``--threads`` torch threads, or two of one; stacked tables and, as
  users' own model runs, one table at a time) against disaggregated with float32 and float16 rows on the wire (one
  dense replica with ``--dense-threads`` threads, ``--shards`` shards of one thread each, cache ``--cache-fraction``
  of the table bytes; and float32 with every table on one shard), all on the same cores (``SAME_CORES``). Per batch
  size: p50/p99 of sequential requests (``--latency-repeats`` runs), rows/s with enough callers to keep the cores
  busy (``callers``) for ``--seconds`` (``--repeats`` runs), CPU per row of each app's processes and the machine's
  idle share, gRPC bytes per request. Systems interleaved; each ratio against the best monolithic system.
- ``scale_out``: N monolithic replicas (each holds every table) against N dense replicas sharing one shard set,
  N in ``--replicas``: total RSS / USS / PSS of every process of each app, rows/s at ``--scale-batch``, rows/s
  per GiB of PSS.
- ``cache``: disaggregated with the cache at ``--cache-fractions`` of the table bytes (LRU and LFU): hit rate and
  rows/s at ``--cache-batch`` under the Zipf generator.
- ``dense_memory``: the dense replica's RSS/USS as tables grow (``--memory-presets``), against an idle replica's
  (the process floor) and the dense parameter bytes.
- ``quality``: AUC of the trained tiny model on held-out click logs with tables stored float16 / int8 and rows
  sent float16 / bfloat16, against float32 (in-process, the same code the shards and dense replicas run).

Writes ``<--out>/bench_dlrm.{json,md}`` (``benchmarks/results`` by default).

    .venv/bin/python -m benchmarks.bench_dlrm [--preset criteo-kaggle] [--sections same_cores scale_out ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ServeDeploySchema

from autoconfig.serve_config import deploy_serve_config
from benchmarks.common import ranges_overlap
from benchmarks.records import RESULTS, machine, provenance, write_results
from disagg.model_source import PresetSource
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from serving.common.allocator import REPLICA_RUNTIME_ENV
from serving.common.memory import serve_processes
from serving.common.net import free_port
from serving.common.tensors import register_ray_serializer

GiB = 2**30
#: Every replica of both layouts: OpenMP threads sleep when a parallel region ends instead of spinning for the next
#: (a replica with two torch threads spent a third of its CPU spinning).
REPLICA_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
#: The same-cores systems. Both layouts' compute pools in the same three shapes: one replica with ``--threads``
#: (``--dense-threads``) torch threads, one of one thread (two batches in flight still use two cores), or two of
#: one thread each (for the monolithic layout, twice the tables); the model's own modules, one table at a time;
#: every table on one shard; ``_call``: lookups as one gRPC call each instead of messages on a stream (the
#: transport before it).
SAME_CORES = {
    "monolithic": {"serving": "monolithic"},
    "monolithic_1x1": {"serving": "monolithic", "threads": 1},
    "monolithic_2x1": {"serving": "monolithic", "replicas": 2, "threads": 1},
    "monolithic_per_table": {"serving": "monolithic", "stacked": False},
    "disagg_fp32": {"serving": "disaggregated"},
    "disagg_fp32_1x1": {"serving": "disaggregated", "threads": 1},
    "disagg_fp32_2x1": {"serving": "disaggregated", "replicas": 2, "threads": 1},
    "disagg_fp32_1shard": {"serving": "disaggregated", "shards": 1},
    "disagg_fp32_call": {"serving": "disaggregated", "transport": "call"},
    "disagg_fp32_call_1x1": {"serving": "disaggregated", "threads": 1, "transport": "call"},
}
#: The same_cores default: the summary's systems, alive at once in 24 GiB with criteo-kaggle's tables
DEFAULT_SYSTEMS = ["monolithic", "monolithic_1x1", "monolithic_2x1", "disagg_fp32", "disagg_fp32_1x1",
                   "disagg_fp32_2x1"]
#: The float32 disaggregated systems the summary ratios take the best of, as they take the best monolithic system.
SUMMARY_DISAGGREGATED = ("disagg_fp32", "disagg_fp32_1x1", "disagg_fp32_2x1")


# -- deployment ----------------------------------------------------------------------------------------------------

def app_config(name: str, args: argparse.Namespace, *, serving: str, preset: str | None = None, replicas: int = 1,
               wire: str = "float32", cache_fraction: float = 0.0, policy: str = "lru", threads: int | None = None,
               storage: str = "float32", stacked: bool = True, shards: int | None = None,
               transport: str = "stream") -> dict[str, Any]:
    """One app of the Serve config: ``name`` at ``/<name>/v2``; ``threads`` (default ``--threads`` monolithic,
    ``--dense-threads`` disaggregated) per monolithic or dense replica; ``shards`` (default ``--shards``);
    ``transport``: how dense replicas send lookups (``EmbeddingServiceConfig.transport``)."""
    shards = shards or args.shards
    spec = preset_spec(preset or args.preset)
    table_bytes = spec.total_rows * spec.embedding_dim * 4
    ingress = "MonolithicDLRM" if serving == "monolithic" else "DisaggregatedDLRM"
    options = {"num_cpus": 0.01, "runtime_env": {"env_vars": REPLICA_ENV}}
    deployments = [{"name": ingress, "num_replicas": replicas, "ray_actor_options": options}]
    if serving == "disaggregated":
        deployments += [{"name": f"EmbeddingShard_{i}", "ray_actor_options": options} for i in range(shards)]
    return {
        "name": name, "route_prefix": f"/{name}/v2", "import_path": "disagg.app:build_app",
        "args": {
            "model": {"preset": preset or args.preset, "weights": "seeded", "stacked_tables": stacked,
                      "torch_threads": threads or (args.threads if serving == "monolithic" else args.dense_threads)},
            "serving": serving,
            "embedding": {"num_shards": shards, "bind_host": "127.0.0.1", "lookup_timeout_s": 30.0,
                          "transport": transport, "torch_threads": 1, "wire_dtype": wire, "storage_dtype": storage,
                          "cache": {"max_bytes": int(cache_fraction * table_bytes), "policy": policy}},
            "batching": {"max_batch_size": args.max_batch_size},
        },
        "deployments": deployments,
    }


def deploy(apps: list[dict[str, Any]], http_port: int) -> dict[str, DeploymentHandle]:
    """Deploys ``apps`` (replacing what runs); the ingress handle of each by app name."""
    config = ServeDeploySchema.model_validate({"http_options": {"host": "127.0.0.1", "port": http_port},
                                               "applications": apps})
    deploy_serve_config(config, timeout_s=1800)
    return {app["name"]: serve.get_deployment_handle(app["deployments"][0]["name"], app_name=app["name"])
            for app in apps}


def app_processes(app: str) -> dict[str, psutil.Process]:
    """Every replica process of ``app`` by its deployment (``<deployment>#<pid>``)."""
    prefix = f"ServeReplica:{app}:"
    return {title.removeprefix(prefix): process for title, process in serve_processes().items()
            if title.startswith(prefix)}


def app_memory(app: str) -> dict[str, float]:
    """Total RSS, USS and PSS (bytes) of every replica process of ``app``."""
    totals = {"rss": 0, "uss": 0, "pss": 0, "processes": 0}
    for process in app_processes(app).values():
        info = process.memory_full_info()
        totals["rss"] += info.rss
        totals["uss"] += info.uss
        totals["pss"] += info.pss
        totals["processes"] += 1
    return totals


def app_cpu_seconds(app: str) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the replica processes of ``app``, summed per deployment."""
    totals: dict[str, float] = {}
    for title, process in app_processes(app).items():
        deployment = title.split("#")[0]
        role = "shards" if deployment.startswith("EmbeddingShard") else deployment
        times = process.cpu_times()
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


# -- load ----------------------------------------------------------------------------------------------------------

class Outcomes:
    """Rows answered and errors seen by concurrent callers."""

    def __init__(self) -> None:
        self.rows = 0
        self.errors: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, rows: int = 0, error: BaseException | None = None) -> None:
        with self._lock:
            self.rows += rows
            if error is not None:
                self.errors[type(error).__name__] = self.errors.get(type(error).__name__, 0) + 1


def latency(handle: DeploymentHandle, batches: list, seconds: float) -> dict[str, Any]:
    """Sequential requests for ``seconds`` (at least 20): p50 and p99 (the maximum when under 100 samples)."""
    durations, outcomes = [], Outcomes()
    deadline = time.perf_counter() + seconds
    index = 0
    while time.perf_counter() < deadline or len(durations) < 20:
        inputs = batches[index % len(batches)]
        index += 1
        started = time.perf_counter()
        try:
            handle.infer.remote(inputs).result(timeout_s=120)
        except Exception as error:  # counted apart, never a success
            outcomes.add(error=error)
            continue
        durations.append(time.perf_counter() - started)
    return {"p50_ms": 1e3 * float(np.percentile(durations, 50)), "p99_ms": 1e3 * float(np.percentile(durations, 99)),
            "samples": len(durations), "errors": outcomes.errors}


def callers(args: argparse.Namespace, batch: int) -> int:
    """Callers that keep both layouts busy at ``batch`` rows per request: ``--rows-in-flight`` rows outstanding,
    within [``--clients``, ``--max-clients``]."""
    return max(args.clients, min(args.max_clients, args.rows_in_flight // batch))


def machine_cpu() -> Any:
    return psutil.cpu_times()


def idle_and_steal(before: Any, after: Any) -> dict[str, float]:
    """Shares of the machine's CPU time idle and stolen by the hypervisor between two ``psutil.cpu_times()``."""
    total = sum(after) - sum(before)
    return {"idle": (after.idle - before.idle) / total, "steal": (after.steal - before.steal) / total}


def throughput(handle: DeploymentHandle, batches: list, clients: int, seconds: float) -> dict[str, Any]:
    """Rows per second with ``clients`` callers, each sending its next request when one returns, for ``seconds``."""
    outcomes = Outcomes()
    deadline = time.perf_counter() + seconds

    def client(offset: int) -> None:
        index = offset
        while time.perf_counter() < deadline:
            inputs = batches[index % len(batches)]
            index += clients
            try:
                handle.infer.remote(inputs).result(timeout_s=300)
                outcomes.add(rows=inputs["dense"].shape[0])
            except Exception as error:
                outcomes.add(error=error)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return {"rows_per_s": outcomes.rows / (time.perf_counter() - started), "rows": outcomes.rows,
            "errors": outcomes.errors}


def grpc_bytes(app: str, shards: int) -> int:
    """Lookup bytes both ways so far, counted by the shard replicas (one each here), so every dense replica's
    traffic counts."""
    return sum(sum(serve.get_deployment_handle(f"EmbeddingShard_{index}", app_name=app).traffic.remote()
                   .result(timeout_s=30)) for index in range(shards))


def cache_counts(handle: DeploymentHandle) -> tuple[int, int]:
    stats = handle.cache_stats.remote().result(timeout_s=30)
    return sum(hits for hits, _ in stats.values()), sum(lookups for _, lookups in stats.values())


def median_range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


# -- sections ------------------------------------------------------------------------------------------------------

def same_cores(args: argparse.Namespace, workload: Callable[[int], list], port: int) -> dict[str, Any]:
    systems = {name: {**SAME_CORES[name], "cache_fraction": args.cache_fraction}
               if SAME_CORES[name]["serving"] == "disaggregated" else SAME_CORES[name] for name in args.systems}
    handles = deploy([app_config(name.replace("_", "-"), args, **options) for name, options in systems.items()], port)
    handles = {name: handles[name.replace("_", "-")] for name in systems}
    rows: dict[str, dict[int, dict[str, list]]] = {name: {} for name in systems}
    for batch in args.batches:
        batches = workload(batch)
        for handle in handles.values():
            handle.infer.remote(batches[0]).result(timeout_s=300)  # warm-up
        for repeat in range(max(args.repeats, args.latency_repeats)):
            order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
            for name in order:
                handle, disaggregated, app = handles[name], name.startswith("disagg"), name.replace("_", "-")
                entry = rows[name].setdefault(batch, {"p50_ms": [], "p99_ms": [], "latency_samples": [],
                                                      "rows_per_s": [], "bytes_per_request": [], "cpu_us_per_row": [],
                                                      "machine": [], "errors": [], "callers": callers(args, batch)})
                if repeat < args.latency_repeats:
                    shards = SAME_CORES[name].get("shards", args.shards)
                    before = grpc_bytes(app, shards) if disaggregated else 0
                    measured = latency(handle, batches, args.latency_seconds)
                    if disaggregated:
                        entry["bytes_per_request"].append((grpc_bytes(app, shards) - before) / measured["samples"])
                    entry["p50_ms"].append(measured["p50_ms"])
                    entry["p99_ms"].append(measured["p99_ms"])
                    entry["latency_samples"].append(measured["samples"])
                    entry["errors"].append(measured["errors"])
                if repeat < args.repeats:
                    cpu_before, machine_before = app_cpu_seconds(app), machine_cpu()
                    served = throughput(handle, batches, entry["callers"], args.seconds)
                    cpu_after, machine_after = app_cpu_seconds(app), machine_cpu()
                    entry["cpu_us_per_row"].append(
                        {role: 1e6 * (cpu_after[role] - cpu_before.get(role, 0.0)) / served["rows"]
                         for role in cpu_after})
                    entry["machine"].append(idle_and_steal(machine_before, machine_after))
                    entry["rows_per_s"].append(served["rows_per_s"])
                    entry["errors"].append(served["errors"])
                print("same_cores", name, batch, repeat, {k: v[-1] for k, v in entry.items()
                                                          if isinstance(v, list) and v}, flush=True)
    serve.shutdown()
    return rows


def scale_out(args: argparse.Namespace, workload: Callable[[int], list], port: int) -> dict[str, Any]:
    """N monolithic replicas against N dense replicas sharing one shard set (float32 tables; int8 tables too);
    each replica gets ``cores // N`` torch threads (at least one), so neither side oversubscribes the cores."""
    systems = {"monolithic": {"serving": "monolithic"}, "disaggregated": {"serving": "disaggregated"},
               "disaggregated_int8": {"serving": "disaggregated", "storage": "int8"}}
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in systems}
    batches = workload(args.scale_batch)
    for replicas in args.replicas:
        threads = max(1, psutil.cpu_count() // replicas)
        names = {name: f"scale-{index}" for index, name in enumerate(systems)}
        handles = deploy([app_config(names[name], args, replicas=replicas, threads=threads, **options)
                          for name, options in systems.items()], port)
        for name in systems:
            handles[names[name]].infer.remote(batches[0]).result(timeout_s=300)
            results[name][replicas] = {"memory": app_memory(names[name]), "rows_per_s": [], "errors": [],
                                       "threads": threads}
        for repeat in range(args.repeats):
            for name in systems if repeat % 2 == 0 else reversed(systems):
                served = throughput(handles[names[name]], batches, callers(args, args.scale_batch), args.seconds)
                results[name][replicas]["rows_per_s"].append(served["rows_per_s"])
                results[name][replicas]["errors"].append(served["errors"])
                print("scale_out", name, replicas, repeat, served, flush=True)
        serve.shutdown()
    return results


def cache_sweep(args: argparse.Namespace, workload: Callable[[int], list], port: int) -> dict[str, Any]:
    """Per policy, one disaggregated app per cache size (each with its own shards) alive at once, interleaved."""
    batches = workload(args.cache_batch)
    results: dict[str, dict[str, list]] = {}
    for policy in ("lru", "lfu"):
        fractions = [f for f in args.cache_fractions if f > 0 or policy == "lru"]
        variants = {f"{policy}-{fraction:g}": fraction for fraction in fractions}
        apps = [app_config(f"cache-{i}", args, serving="disaggregated", cache_fraction=fraction, policy=policy)
                for i, fraction in enumerate(variants.values())]
        handles = dict(zip(variants, deploy(apps, port).values(), strict=True))
        results |= {name: {"hit_rate": [], "rows_per_s": [], "errors": []} for name in variants}
        for handle in handles.values():  # warm the caches with the same stream the runs use
            for batch in batches[: args.warm_batches]:
                handle.infer.remote(batch).result(timeout_s=300)
        for repeat in range(args.repeats):
            for name in variants if repeat % 2 == 0 else reversed(variants):
                hits_before, lookups_before = cache_counts(handles[name])
                served = throughput(handles[name], batches, args.clients, args.seconds)
                hits, lookups = cache_counts(handles[name])
                results[name]["hit_rate"].append((hits - hits_before) / max(1, lookups - lookups_before))
                results[name]["rows_per_s"].append(served["rows_per_s"])
                results[name]["errors"].append(served["errors"])
                print("cache", name, repeat, results[name]["hit_rate"][-1], served, flush=True)
        serve.shutdown()
    return results


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
class IdleReplica:
    """A replica that imports what a dense replica imports and holds nothing: the process floor."""

    def __init__(self) -> None:
        import disagg.deployments.disaggregated  # noqa: F401

    def __call__(self) -> str:
        return "ok"


def dense_memory(args: argparse.Namespace, port: int) -> dict[str, Any]:
    from disagg.partition import build_dense_part

    serve.run(IdleReplica.bind(), name="floor", route_prefix="/floor")
    floor = app_memory("floor")
    serve.delete("floor")
    results: dict[str, Any] = {"floor": floor, "presets": {}}
    for preset in args.memory_presets:
        spec = preset_spec(preset)
        handle = deploy([app_config("dense-mem", args, serving="disaggregated", preset=preset)], port)["dense-mem"]
        dense, sparse = SyntheticRequests(spec, seed=0).batch(args.scale_batch)
        handle.infer.remote({"dense": dense, "sparse": sparse}).result(timeout_s=300)
        dense = build_dense_part(PresetSource(preset, 0)).dense_part
        memory = {title: process.memory_full_info() for title, process in serve_processes().items()
                  if title.startswith("ServeReplica:dense-mem:DisaggregatedDLRM")}
        info = next(iter(memory.values()))
        results["presets"][preset] = {
            "table_bytes": spec.total_rows * spec.embedding_dim * 4, "rss": info.rss, "uss": info.uss,
            "dense_parameter_bytes": sum(t.numel() * t.element_size() for t in dense.parameters()),
            "dense_buffer_bytes": sum(t.numel() * t.element_size() for t in dense.buffers()),
        }
        print("dense_memory", preset, results["presets"][preset], flush=True)
        serve.shutdown()
    return results


def quality(args: argparse.Namespace) -> dict[str, Any]:
    from training.precision import precision_auc

    return precision_auc(rows=args.quality_rows)


# -- report --------------------------------------------------------------------------------------------------------

def report(args: argparse.Namespace, results: dict[str, Any]) -> tuple[str, dict[str, float]]:
    lines = [f"# DLRM {args.preset}: disaggregated ({args.shards} shards) vs monolithic ({machine()['device']}, "
             f"{psutil.cpu_count()} cores; medians of {args.repeats} interleaved runs, [min, max])", ""]
    summary: dict[str, float] = {}
    if same := results.get("same_cores"):
        lines += ["## Same cores", "",
                  f"Every system on the same {psutil.cpu_count()} cores; monolithic replicas {args.threads} torch "
                  f"threads, dense replica {args.dense_threads}, shards 1 "
                  f"each, cache {args.cache_fraction:.0%} of the table bytes; every replica with "
                  f"{', '.join(f'{k}={v}' for k, v in REPLICA_ENV.items())}. Throughput: the callers column's "
                  f"concurrent callers (about {args.rows_in_flight:,} rows in flight) for {args.seconds:g} s per run "
                  f"({args.repeats} runs); latency: sequential requests for {args.latency_seconds:g} s per run "
                  f"({args.latency_repeats} runs), p99 over all of a run's requests, written `max` where a run had "
                  "fewer than 100. `monolithic` stacks each width's tables and pools every bag in one call "
                  "(`model.stacked_tables`, the default); `monolithic_per_table` runs the model's own modules, one "
                  "table at a time; `_1x1`: one replica of one torch thread; `_2x1`: two of one. Ratios are "
                  "against the best monolithic system at each batch size on that measure (most rows/s, lowest p50, "
                  "least CPU per row); the "
                  f"summary's take the best of {', '.join(f'`{name}`' for name in SUMMARY_DISAGGREGATED)} on the "
                  "same measure. `disagg_fp32_1shard` holds every table on one shard.", "",
                  "CPU µs per row: CPU time of the app's replica processes during the throughput runs over the rows "
                  "answered, in all and (ingress + shard directory + shards); the load generator is not counted. "
                  "Idle: the machine's idle share during the throughput runs.", "",
                  "| batch | system | callers | p50 ms | p99 ms | rows/s | throughput vs mono | p50 vs mono | "
                  "bytes/request | CPU µs/row | CPU vs mono | idle |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        worst_throughput, worst_p50 = [], []
        monoliths = [name for name in same if name.startswith("monolithic")]
        ours = [name for name in SUMMARY_DISAGGREGATED if name in same]
        for batch in _measured_sizes(same):
            best = {measure: _best(same, monoliths, batch, measure) for measure in ("rows_per_s", "p50_ms", "cpu")}
            for name, entry in same.items():
                row = entry[batch]
                ratios = {measure: _measure(row, measure) / _measure(best[measure], measure) for measure in best}
                tie = (" (tie)" if row is not best["rows_per_s"]
                       and ranges_overlap(row["rows_per_s"], best["rows_per_s"]["rows_per_s"]) else "")
                bytes_cell = f"{statistics.median(row['bytes_per_request']):,.0f}" if row["bytes_per_request"] else "-"
                idle = statistics.median(run["idle"] for run in row["machine"]) if row.get("machine") else None
                lines.append(
                    f"| {batch} | {name} | {row.get('callers', args.clients)} | {_cell(row['p50_ms'])} | "
                    f"{_p99_cell(row)} | {_cell(row['rows_per_s'], '.0f')} | {ratios['rows_per_s']:.2f}x{tie} | "
                    f"{ratios['p50_ms']:.2f}x | {bytes_cell} | {_cpu_cell(row['cpu_us_per_row'])} | "
                    f"{ratios['cpu']:.2f}x | {'-' if idle is None else f'{idle:.0%}'} |")
            if ours:
                worst_throughput.append(_measure(_best(same, ours, batch, "rows_per_s"), "rows_per_s")
                                        / _measure(best["rows_per_s"], "rows_per_s"))
                worst_p50.append(_measure(_best(same, ours, batch, "p50_ms"), "p50_ms")
                                 / _measure(best["p50_ms"], "p50_ms"))
                if batch in (32, 256):
                    summary[f"cpu_per_row_ratio_b{batch}"] = (_measure(_best(same, ours, batch, "cpu"), "cpu")
                                                              / _measure(best["cpu"], "cpu"))
        summary["throughput_ratio_same_cores"] = min(worst_throughput)
        summary["p50_ratio_same_cores"] = max(worst_p50)
        lines.append("")
    if scale := results.get("scale_out"):
        lines += ["## Scale-out: N replicas, each monolithic one holding every table, the dense ones sharing one "
                  "shard set", "",
                  f"Batch {args.scale_batch}, {callers(args, args.scale_batch)} callers, each replica "
                  f"{psutil.cpu_count()} // N torch threads (at least 1); memory is the sum over every replica "
                  "process of the app (shards and directory included); PSS counts pages shared between processes "
                  "(torch's libraries) once in all. `disaggregated_int8` stores the tables int8 row-wise. Summary "
                  "ratios: `disaggregated` (float32 tables) against `monolithic`, by PSS.", "",
                  "| N | system | RSS GiB | USS GiB | PSS GiB | rows/s | rows/s per GiB PSS |",
                  "|---|---|---|---|---|---|---|"]
        counts = _measured_sizes(scale)
        for replicas in counts:
            for name, entry in ((name, by_n[replicas]) for name, by_n in scale.items()):
                memory, rate = entry["memory"], statistics.median(entry["rows_per_s"])
                lines.append(f"| {replicas} | {name} | {memory['rss'] / GiB:.2f} | {memory['uss'] / GiB:.2f} | "
                             f"{memory['pss'] / GiB:.2f} | {_cell(entry['rows_per_s'], '.0f')} | "
                             f"{rate / (memory['pss'] / GiB):.0f} |")
        top = max(counts)
        mono, dis = scale["monolithic"][top], scale["disaggregated"][top]
        summary[f"memory_ratio_n{top}"] = dis["memory"]["pss"] / mono["memory"]["pss"]
        summary[f"throughput_per_gib_ratio_n{top}"] = (
            statistics.median(dis["rows_per_s"]) / dis["memory"]["pss"]
        ) / (statistics.median(mono["rows_per_s"]) / mono["memory"]["pss"])
        lines.append("")
    if cache := results.get("cache"):
        lines += ["## Hot-embedding cache (Zipf ids)", "",
                  f"Batch {args.cache_batch}; cache size as a fraction of the table bytes; hit rate over unique ids "
                  f"per batch (after deduplication); caches warmed with {args.warm_batches} batches of the stream; "
                  "the sizes of one policy interleaved.", "",
                  "| cache | hit rate | rows/s |", "|---|---|---|"]
        for name, entry in cache.items():
            lines.append(f"| {name} | {_cell(entry['hit_rate'], '.3f')} | {_cell(entry['rows_per_s'], '.0f')} |")
        lines.append("")
    if memory := results.get("dense_memory"):
        floor = memory["floor"]
        lines += ["## Dense replica memory as the tables grow", "",
                  f"Idle replica (the process floor): RSS {floor['rss'] / 2**20:.0f} MiB, USS "
                  f"{floor['uss'] / 2**20:.0f} MiB.", "",
                  "| preset | table MiB | dense RSS MiB | dense USS MiB | dense parameters MiB | "
                  "USS over the floor MiB |",
                  "|---|---|---|---|---|---|"]
        for preset, entry in memory["presets"].items():
            lines.append(f"| {preset} | {entry['table_bytes'] / 2**20:.0f} | {entry['rss'] / 2**20:.0f} | "
                         f"{entry['uss'] / 2**20:.0f} | {entry['dense_parameter_bytes'] / 2**20:.1f} | "
                         f"{(entry['uss'] - floor['uss']) / 2**20:.0f} |")
        lines.append("")
    if auc := results.get("quality"):
        lines += ["## Quality of reduced precision (trained tiny model, held-out click logs)", "",
                  "| tables | wire | AUC | change vs float32 | max abs prediction change |", "|---|---|---|---|---|"]
        for entry in auc["rows"]:
            lines.append(f"| {entry['storage']} | {entry['wire']} | {entry['auc']:.4f} | {entry['auc_change']:+.4f} | "
                         f"{entry['max_abs_prediction_change']:.2e} |")
        summary["auc_change_int8"] = auc["auc_change_int8"]
        lines.append("")
    return "\n".join(lines), summary


def _measured_sizes(section: dict[str, dict[int, Any]]) -> list[int]:
    """The batch sizes (or replica counts) a section measured every system at: a section carried over from an
    earlier run has that run's, not this run's arguments'."""
    return sorted(set.intersection(*(set(by_size) for by_size in section.values())))


def _measure(row: dict[str, Any], measure: str) -> float:
    """A row's median rows/s, p50 ms, or CPU µs per row (``cpu``)."""
    return _cpu_total(row["cpu_us_per_row"]) if measure == "cpu" else statistics.median(row[measure])


def _best(same: dict[str, Any], names: list[str], batch: int, measure: str) -> dict[str, Any]:
    """The row of ``names`` at ``batch`` best on ``measure``: most rows/s, else the least."""
    rows = [same[name][batch] for name in names]
    return (max if measure == "rows_per_s" else min)(rows, key=lambda row: _measure(row, measure))


def _cpu_total(runs: list[dict[str, float]]) -> float:
    """Median over ``runs`` of the CPU µs per row of every process (the sum of each role's median)."""
    roles = {role for run in runs for role in run}
    return sum(statistics.median(run.get(role, 0.0) for run in runs) for role in roles)


def _p99_cell(row: dict[str, Any]) -> str:
    """p99 of the latency runs, written ``max`` when a run had fewer than 100 requests (its p99 is its maximum)."""
    cell = _cell(row["p99_ms"])
    samples = row.get("latency_samples")
    return f"{cell} max" if samples and min(samples) < 100 else cell


def _cpu_cell(runs: list[dict[str, float]]) -> str:
    """Median CPU µs per row of each role over ``runs``: ``total (ingress + directory + shards)``."""
    order = {"ShardDirectory": 1, "shards": 2}  # the ingress deployment first
    roles = sorted({role for run in runs for role in run}, key=lambda role: order.get(role, 0))
    medians = {role: statistics.median(run.get(role, 0.0) for run in runs) for role in roles}
    parts = " + ".join(f"{value:.1f}" for value in medians.values())
    return f"{sum(medians.values()):.1f}" + (f" ({parts})" if len(medians) > 1 else "")


def _cell(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="criteo-kaggle")
    parser.add_argument("--sections", nargs="+", default=["same_cores", "scale_out", "cache", "dense_memory",
                                                           "quality"])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256, 2048])
    parser.add_argument("--systems", nargs="+", choices=list(SAME_CORES), default=DEFAULT_SYSTEMS,
                        help="same_cores systems, alive at once (each monolithic replica holds every table)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each throughput run")
    parser.add_argument("--latency-seconds", type=float, default=6.0, help="length of each latency run")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per point (latency: see below)")
    parser.add_argument("--latency-repeats", type=int, default=5, help="latency runs per point")
    parser.add_argument("--clients", type=int, default=8, help="fewest concurrent callers of a throughput run")
    parser.add_argument("--max-clients", type=int, default=32, help="most concurrent callers of a throughput run")
    parser.add_argument("--rows-in-flight", type=int, default=16384,
                        help="rows outstanding in a throughput run: callers = this / batch, within the two bounds")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each monolithic replica")
    parser.add_argument("--dense-threads", type=int, default=2, help="torch threads of each dense replica")
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests merged into one batch (both)")
    parser.add_argument("--cache-fraction", type=float, default=0.0,
                        help="dense replicas' cache in same_cores (the cache section measures it apart)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--scale-batch", type=int, default=256)
    parser.add_argument("--cache-fractions", type=float, nargs="+", default=[0.0, 0.01, 0.05, 0.2])
    parser.add_argument("--cache-batch", type=int, default=2048)
    parser.add_argument("--warm-batches", type=int, default=20)
    parser.add_argument("--memory-presets", nargs="+", default=["tiny", "small", "criteo-kaggle"])
    parser.add_argument("--quality-rows", type=int, default=65536)
    parser.add_argument("--requests", type=int, default=64, help="distinct generated requests per batch size")
    parser.add_argument("--object-store-gib", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="directory of the result files (sections not rerun are carried over from there)")
    return parser


def main() -> None:
    args = arguments().parse_args()
    spec = preset_spec(args.preset)
    generated: dict[int, list] = {}

    def workload(rows: int) -> list:
        """``args.requests`` requests of ``rows`` rows, as the replicas' ``infer`` takes them (by forward argument)."""
        if rows not in generated:
            generator = SyntheticRequests(spec, seed=rows)
            generated[rows] = [dict(zip(("dense", "sparse"), generator.batch(rows), strict=True))
                               for _ in range(args.requests)]
        return generated[rows]

    torch.set_num_threads(1)  # the benchmark process only sends requests
    results: dict[str, Any] = {}
    ray.init(num_cpus=psutil.cpu_count(), include_dashboard=False,
             object_store_memory=int(args.object_store_gib * GiB),
             runtime_env=REPLICA_RUNTIME_ENV)  # every system's replicas start as ours do
    register_ray_serializer()  # requests travel as numpy arrays, as the replicas' answers do
    try:
        port = free_port()
        for section in args.sections:
            if section == "same_cores":
                results[section] = same_cores(args, workload, port)
            elif section == "scale_out":
                results[section] = scale_out(args, workload, port)
            elif section == "cache":
                results[section] = cache_sweep(args, workload, port)
            elif section == "dense_memory":
                results[section] = dense_memory(args, port)
            elif section == "quality":
                results[section] = quality(args)
            else:
                raise SystemExit(f"unknown section {section!r}")
    finally:
        serve.shutdown()
        ray.shutdown()
    carried = carry_over(results, args.out / "bench_dlrm.json")
    table, summary = report(args, results)
    if carried:
        table += "\n" + "Sections not rerun, carried over from earlier runs: " + ", ".join(
            f"{section} (commit {commit[:10]})" for section, commit in carried.items()) + "\n"
    print(table)
    write_results("bench_dlrm", {**provenance(), "machine": machine(), "args": vars(args),
                                 "summary": summary, "rows": results, "carried_over": carried}, table, args.out)


def carry_over(results: dict[str, Any], path: Path) -> dict[str, str]:
    """Adds to ``results`` the sections of the results at ``path`` this run did not measure; their commits by
    section (the commit that measured each)."""
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())
    carried = {}
    for section, rows in previous["rows"].items():
        if section not in results:
            results[section] = _with_int_keys(rows)
            carried[section] = previous.get("carried_over", {}).get(section, previous["commit"])
    return carried


def _with_int_keys(value: Any) -> Any:
    """``value`` read back from JSON, whose object keys are strings: the sections' batch sizes and replica counts
    become ints again, as the measuring code writes them."""
    if isinstance(value, dict):
        return {int(key) if key.isdecimal() else key: _with_int_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_int_keys(item) for item in value]
    return value


if __name__ == "__main__":
    main()
