"""Disaggregated DLRM serving against the monolithic baseline, same model, same total CPUs, one run.

``criteo-kaggle`` preset (33.76M rows, 2.2 GB of FP32 tables). One Ray cluster of ``--cpus`` CPUs hosts one
system at a time:

- monolithic: one ``MonolithicDLRM`` replica with every CPU (all tables and the MLPs);
- disaggregated: one ``DisaggregatedDLRM`` dense replica (half the CPUs) and ``--shards`` embedding shards
  (gRPC servers, the other half shared among them).

Requests come from the synthetic generator (power-law ids, one-hot) and go through the deployments' handles
(``infer``), so both sides skip the same HTTP layer. Per batch size: p50/p99 latency of sequential requests,
then throughput with ``--clients`` concurrent callers (saturation); for the disaggregated side also gRPC bytes
per request; finally the RSS of the dense replica against the embedding bytes. Writes
``benchmarks/results/bench_dlrm.{json,md}``.

    .venv/bin/python -m benchmarks.bench_dlrm [--batches 1 32 256 2048] [--requests 40] [--clients 8]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ServeDeploySchema

from autoconfig.serve_config import deploy_serve_config
from benchmarks.common import machine, write_results
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from serving.common.net import free_port

APP = "dlrm-bench"


def deploy(serving: str, args: argparse.Namespace, http_port: int) -> DeploymentHandle:
    """The app under test, sized to ``args.cpus`` in total, deployed as a Serve config; its ingress handle."""
    threads = args.dense_threads if serving == "disaggregated" else None
    if serving == "monolithic":
        cpus = {"MonolithicDLRM": args.cpus}
    else:  # half for the dense replica, half shared by the shards
        cpus = {"DisaggregatedDLRM": args.cpus / 2, "ShardDirectory": 0,
                **{f"EmbeddingShard_{i}": args.cpus / 2 / args.shards for i in range(args.shards)}}
    config = ServeDeploySchema.model_validate({
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [{
            "name": APP, "route_prefix": "/v2", "import_path": "disagg.app:build_app",
            "args": {"model": {"preset": args.preset, "torch_threads": threads}, "serving": serving,
                     "embedding": {"num_shards": args.shards, "bind_host": "127.0.0.1", "lookup_timeout_s": 30.0}},
            "deployments": [{"name": name, "ray_actor_options": {"num_cpus": n}} for name, n in cpus.items()],
        }],
    })
    deploy_serve_config(config, timeout_s=900)
    ingress = "MonolithicDLRM" if serving == "monolithic" else "DisaggregatedDLRM"
    return serve.get_deployment_handle(ingress, app_name=APP)


def latency(handle, batches: list, repeats: int) -> dict[str, float]:
    seconds = []
    for dense, sparse in batches[:repeats]:
        started = time.perf_counter()
        handle.infer.remote(dense, sparse).result(timeout_s=120)
        seconds.append(time.perf_counter() - started)
    return {"p50_ms": 1e3 * float(np.percentile(seconds, 50)), "p99_ms": 1e3 * float(np.percentile(seconds, 99))}


def throughput(handle, batches: list, clients: int) -> float:
    """Rows per second with ``clients`` callers each sending its next request as soon as one returns."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda batch: handle.infer.remote(*batch).result(timeout_s=300), batches))
    return sum(dense.shape[0] for dense, _ in batches) / (time.perf_counter() - started)


def grpc_bytes(handle) -> int:
    stats = handle.embedding_stats.remote().result(timeout_s=30)
    return sum(shard.bytes_sent + shard.bytes_received for shard in stats.values())


def measure(serving: str, args: argparse.Namespace, workload: dict[int, list], http_port: int) -> dict:
    handle = deploy(serving, args, http_port)
    result: dict = {"batches": {}}
    for rows, batches in workload.items():
        handle.infer.remote(*batches[0]).result(timeout_s=300)  # warm-up
        before = grpc_bytes(handle) if serving == "disaggregated" else 0
        entry = latency(handle, batches, args.requests)
        if serving == "disaggregated":
            entry["grpc_bytes_per_request"] = (grpc_bytes(handle) - before) / min(args.requests, len(batches))
        entry["rows_per_s"] = throughput(handle, batches, args.clients)
        result["batches"][rows] = entry
        print(serving, rows, entry, flush=True)
    memory = handle.memory_report.remote().result(timeout_s=60)
    result["ingress_rss_bytes"], result["ingress_uss_bytes"] = memory.rss_bytes, memory.uss_bytes
    serve.delete(APP)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="criteo-kaggle")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256, 2048])
    parser.add_argument("--requests", type=int, default=40, help="requests per batch size (latency and throughput)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent callers in the throughput run")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the Ray cluster, for each system")
    parser.add_argument("--dense-threads", type=int, default=None,
                        help="torch threads of the disaggregated dense replica (default: its num_cpus, floored)")
    args = parser.parse_args()
    spec = preset_spec(args.preset)
    generator = SyntheticRequests(spec, seed=0)
    workload = {rows: [generator.batch(rows) for _ in range(args.requests)] for rows in args.batches}
    table_bytes = spec.total_rows * spec.embedding_dim * 4
    ray.init(num_cpus=args.cpus, include_dashboard=False, object_store_memory=1 * 2**30)
    try:
        port = free_port()
        results = {serving: measure(serving, args, workload, port) for serving in ("monolithic", "disaggregated")}
    finally:
        serve.shutdown()
        ray.shutdown()

    mono, disagg = results["monolithic"]["batches"], results["disaggregated"]["batches"]
    lines = [
        f"# DLRM {args.preset}: disaggregated ({args.shards} shards) vs monolithic, {args.cpus} CPUs each "
        f"({machine()['device']}), {args.requests} requests per batch size, {args.clients} clients at saturation",
        "",
        "| batch | mono p50 ms | disagg p50 ms | p50 ratio | mono p99 ms | disagg p99 ms | mono rows/s | "
        "disagg rows/s | throughput ratio | gRPC bytes/request |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rows in args.batches:
        m, d = mono[rows], disagg[rows]
        lines.append(
            f"| {rows} | {m['p50_ms']:.1f} | {d['p50_ms']:.1f} | {d['p50_ms'] / m['p50_ms']:.2f}x | "
            f"{m['p99_ms']:.1f} | {d['p99_ms']:.1f} | {m['rows_per_s']:.0f} | {d['rows_per_s']:.0f} | "
            f"{d['rows_per_s'] / m['rows_per_s']:.2f}x | {d['grpc_bytes_per_request']:,.0f} |"
        )
    dense, whole = results["disaggregated"], results["monolithic"]
    lines += [
        "",
        f"Embedding tables: {table_bytes / 2**30:.2f} GiB. Dense replica: RSS {dense['ingress_rss_bytes'] / 2**20:.0f} "
        f"MiB ({100 * dense['ingress_rss_bytes'] / table_bytes:.1f}% of the table bytes), unshared (USS) "
        f"{dense['ingress_uss_bytes'] / 2**20:.0f} MiB ({100 * dense['ingress_uss_bytes'] / table_bytes:.1f}%). "
        f"Monolithic replica: RSS {whole['ingress_rss_bytes'] / 2**20:.0f} MiB, USS "
        f"{whole['ingress_uss_bytes'] / 2**20:.0f} MiB.",
    ]
    table = "\n".join(lines)
    print(table)
    write_results("bench_dlrm", {"machine": machine(), "args": vars(args), "table_bytes": table_bytes,
                                 "results": results}, table)


if __name__ == "__main__":
    main()
