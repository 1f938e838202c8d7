"""The gRPC servers grpcio offers for one embedding shard, measured against the shard's own tensor work.

A criteo-kaggle shard (``--preset``, shard 0 of ``--num-shards`` as the app lays them out) is served by each flavour
in a process of its own with one torch thread; a client process sends it the packed lookups the dense replicas send
(each batch of ``--batches`` rows deduplicated as ``RemoteEmbeddings.prepare`` does, this shard's part) with
``--in-flight`` calls outstanding, for ``--seconds`` per run, flavours interleaved over ``--repeats`` runs. Per
flavour: server CPU µs per call (user + system, from ``/proc``), calls per second, and the machinery (CPU per call
minus the tensor work: one gather of the call's rows into a buffer, timed alone in this process).

Flavours:
- ``aio-pool-protobuf``: what the shard server ran before issue 45: ``grpc.aio``, protobuf messages (the reply
  built from per-slice tensors: concatenated, encoded, serialized), every lookup in a thread pool.
- ``aio-pool``: ``grpc.aio``, the reply written by hand (``disagg.rpc.packed``) around one gather, in the pool.
- ``aio-inline``: the same on the event loop (no thread hop): what ``EmbeddingServer`` runs below
  ``inline_max_ids`` (``KEPT``).
- ``aio-inline-uvloop``: the same on uvloop, the loop a Serve replica runs user code on.
- ``sync-pool``: grpcio's synchronous server (a thread pool of ``--sync-threads``), the hand-written reply.
- ``aio-null``: ``aio-inline`` answering every call with the same 16 bytes, no lookup: grpcio's own cost of a call
  carrying the request (the floor under any flavour), beside which the others' machinery is read.
- ``aio-stream``: the lookups as messages on one ``LookupStream`` call (``--in-flight`` outstanding), answered on the
  event loop: what dense replicas use by default (``EmbeddingServiceConfig.transport``).

Summary: the kept flavour's machinery over the tensor work, and the server CPU per call before issue 45 over the
kept flavour's, per batch size.

    .venv/bin/python -m benchmarks.bench_shard_server [--batches 32 256 2048] [--seconds 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import psutil
import torch

from benchmarks.records import RESULTS, machine, provenance, write_results
from disagg.config import EmbeddingServiceConfig
from disagg.lookup import RemoteEmbeddings
from disagg.model_source import PresetSource
from disagg.partition import build_dense_part, embedding_lookups
from disagg.rpc import packed, wire
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc.server import SERVICE_NAME, _Refusal, _Servicer
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from disagg.tables import TableLayout, TableShard, build_embedding_shard

FLAVOURS = ("aio-pool-protobuf", "aio-pool", "aio-inline", "aio-inline-uvloop", "sync-pool", "aio-null", "aio-stream")
#: What the product's shard server runs for a dense replica (``disagg.rpc.server.EmbeddingServer`` below
#: ``INLINE_MAX_IDS`` ids, lookups on a stream)
KEPT = "aio-stream"
#: The flavour whose lookups are messages on one stream rather than calls
STREAM = "aio-stream"
_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
#: The flavour that serves no rows: its whole CPU is grpcio's per-call machinery
NULL = "aio-null"
_NULL_REPLY = bytes(16)


def shard_and_requests(args: argparse.Namespace, batch: int) -> tuple[TableShard, list[bytes]]:
    """Shard 0 and ``--requests`` packed lookups of it, each one batch of ``batch`` rows after dedup."""
    source = PresetSource(args.preset, 0)
    layout = _layout(args)
    lookups = embedding_lookups(build_dense_part(source))
    embeddings = RemoteEmbeddings(lookups, layout.plan(lookups.tables), source=None)  # prepare only: no calls
    generator = SyntheticRequests(preset_spec(args.preset), seed=batch)
    requests = []
    for _ in range(args.requests):
        _, sparse = generator.batch(batch)
        call = next(call for call in embeddings.prepare({"sparse": sparse}).calls if call.shard == 0)
        requests.append(packed.encode_request(call.ids, call.counts))
    return build_embedding_shard(source, 0, layout), requests


def _layout(args: argparse.Namespace) -> TableLayout:
    """The served app's layout at ``--num-shards`` (big tables split row-wise over every shard)."""
    return EmbeddingServiceConfig(num_shards=args.num_shards).layout()


def protobuf_reply(shard: TableShard, raw: bytes) -> bytes:
    """The reply as the server built it before issue 45: per-slice rows, concatenated, encoded, serialized."""
    request = pb.LookupRequest.FromString(raw)
    ids = wire.decode(request.ids)
    outputs = shard.module(**dict(zip(shard.input_names, ids.split(list(request.counts)), strict=True)))
    rows = torch.cat([outputs[name].reshape(-1) for name in shard.output_names])
    return pb.LookupResponse(rows=wire.encode("rows", rows), widths=[o.shape[1] for o in outputs.values()],
                             version=shard.version).SerializeToString()


def serve(flavour: str, args: argparse.Namespace, ready: Any, stop: Any) -> None:
    """Serves shard 0 in flavour ``flavour`` until ``stop`` is set; puts (port, pid) on ``ready``."""
    torch.set_num_threads(1)
    shard = build_embedding_shard(PresetSource(args.preset, 0), 0, _layout(args))
    pool = ThreadPoolExecutor(args.sync_threads if flavour == "sync-pool" else 2)
    servicer = _Servicer(shard, pb.ShardInfo(), pool, wire.DEFAULT_MAX_ELEMENTS)
    answer = {"aio-pool-protobuf": lambda raw: protobuf_reply(shard, raw),
              NULL: lambda raw: _NULL_REPLY}.get(flavour, servicer.answer)
    if flavour == "sync-pool":
        def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                return answer(raw)
            except _Refusal as refusal:
                context.abort(refusal.code, refusal.details)

        server = grpc.server(pool, options=_OPTIONS)
        _add(server, handle)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        ready.put((port, multiprocessing.current_process().pid))
        stop.wait()
        server.stop(0)
        return

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if flavour.startswith("aio-inline") or flavour == NULL:
                return answer(raw)
            return await loop.run_in_executor(pool, answer, raw)

        async def handle_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for reply in servicer.LookupStream(requests, context):
                yield reply

        server = grpc.aio.server(options=_OPTIONS)
        _add(server, handle, handle_stream)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.put((port, multiprocessing.current_process().pid))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(0)

    if flavour.endswith("uvloop"):  # the loop a Serve replica runs its user code on
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _add(server: Any, handle: Any, handle_stream: Any = None) -> None:
    handlers = {"Lookup": grpc.unary_unary_rpc_method_handler(handle)}
    if handle_stream is not None:
        handlers["LookupStream"] = grpc.stream_stream_rpc_method_handler(handle_stream)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def tensor_work_us(shard: TableShard, requests: list[bytes], calls: int) -> float:
    """Thread CPU µs of the shard's tensor work per call: the ids viewed, every slice's rows gathered into one
    buffer (``TableLookup.gather``), nothing else."""
    parsed = [packed.parse_request(raw) for raw in requests]
    started = time.thread_time()
    for index in range(calls):
        request = parsed[index % len(parsed)]
        shard.module.gather(list(request.ids.split(request.counts)), torch.float32)
    return 1e6 * (time.thread_time() - started) / calls


def drive(port: int, pid: int, requests: list[bytes], args: argparse.Namespace, stream: bool = False) -> dict[str, Any]:
    """``--in-flight`` lookups outstanding for ``--seconds``, sent by a ``grpc.aio`` client as the dense replicas'
    is: ``--in-flight`` callers of ``Lookup``, or (``stream``) ``--in-flight`` messages outstanding on one
    ``LookupStream``, the next written as each reply arrives. Calls per second and the server's CPU per call."""
    return asyncio.run(_drive(port, psutil.Process(pid), requests, args, stream))


async def _drive(port: int, process: psutil.Process, requests: list[bytes], args: argparse.Namespace,
                 stream: bool) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/Lookup")
        lookups = channel.stream_stream(f"/{SERVICE_NAME}/LookupStream")() if stream else None
        for raw in requests[:8]:  # warm-up
            if lookups is None:
                await call(raw, timeout=30)
            else:
                await lookups.write(raw)
                await lookups.read()
        errors = 0
        before, started = process.cpu_times(), time.perf_counter()
        deadline = started + args.seconds
        if lookups is None:
            answered = [0] * args.in_flight

            async def caller(slot: int) -> None:
                nonlocal errors
                index = slot
                while time.perf_counter() < deadline:
                    try:
                        await call(requests[index % len(requests)], timeout=30)
                        answered[slot] += 1
                    except grpc.aio.AioRpcError:
                        errors += 1
                    index += args.in_flight

            await asyncio.gather(*(caller(slot) for slot in range(args.in_flight)))
            calls = sum(answered)
        else:
            sent = calls = 0
            for _ in range(args.in_flight):
                await lookups.write(requests[sent % len(requests)])
                sent += 1
            while calls < sent:
                reply = await lookups.read()
                if packed.stream_header(reply).status:
                    errors += 1
                else:
                    calls += 1
                if time.perf_counter() < deadline:
                    await lookups.write(requests[sent % len(requests)])
                    sent += 1
                elif calls + errors >= sent:
                    break
            await lookups.done_writing()
        after, elapsed = process.cpu_times(), time.perf_counter() - started
    return {"calls_per_s": calls / elapsed, "calls": calls, "errors": errors,
            "cpu_us_per_call": 1e6 * ((after.user - before.user) + (after.system - before.system)) / max(1, calls),
            "system_us_per_call": 1e6 * (after.system - before.system) / max(1, calls)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    servers = {}
    for flavour in args.flavours:  # every flavour up at once, so runs interleave without restarts
        process = context.Process(target=serve, args=(flavour, args, ready, stop), daemon=True)
        process.start()
        servers[flavour] = process
    ports: dict[int, int] = {}
    for _ in args.flavours:
        port, pid = ready.get(timeout=900)
        ports[pid] = port
    by_pid = {process.pid: flavour for flavour, process in servers.items()}
    endpoints = {by_pid[pid]: (port, pid) for pid, port in ports.items()}
    results: dict[str, Any] = {}
    try:
        for batch in args.batches:
            shard, requests = shard_and_requests(args, batch)
            work = [tensor_work_us(shard, requests, args.work_calls) for _ in range(args.repeats)]
            ids = statistics.mean(packed.parse_request(raw).ids.shape[0] for raw in requests)
            del shard
            entry = results[batch] = {"ids_per_call": ids, "request_bytes": statistics.mean(map(len, requests)),
                                      "tensor_work_us": work, "flavours": {f: [] for f in args.flavours}}
            for repeat in range(args.repeats):
                order = args.flavours if repeat % 2 == 0 else list(reversed(args.flavours))
                for flavour in order:
                    run = drive(*endpoints[flavour], requests, args, stream=flavour == STREAM)
                    entry["flavours"][flavour].append(run)
                    print(f"batch {batch} {flavour} run {repeat}: {run}", flush=True)
    finally:
        stop.set()
        for process in servers.values():
            process.join(timeout=30)
    return results


def report(args: argparse.Namespace, results: dict[str, Any]) -> tuple[str, dict[str, float]]:
    lines = [f"# Embedding shard servers: {args.preset} shard 0 of {args.num_shards} ({machine()['cpu']}, "
             f"{psutil.cpu_count()} cores; medians of {args.repeats} interleaved runs, [min, max])", "",
             f"Server and client in processes of their own, one torch thread, loopback TCP, {args.in_flight} calls in "
             f"flight, {args.seconds:g} s per run. CPU is the server process's (user + system) per answered call; "
             "machinery is that minus the tensor work (one gather of the call's rows into a buffer, timed alone); "
             f"`vs tensor work` is machinery over tensor work (`{NULL}` does none: all its CPU is machinery).", "",
             "| batch | ids per call | tensor work µs | flavour | calls/s | CPU µs per call | system µs | "
             "machinery µs | vs tensor work | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    summary: dict[str, float] = {}
    for batch, entry in results.items():
        work = statistics.median(entry["tensor_work_us"])
        medians = {}
        for flavour, runs in entry["flavours"].items():
            cpu = [run["cpu_us_per_call"] for run in runs]
            medians[flavour] = statistics.median(cpu)
            served = 0.0 if flavour == NULL else work
            machinery = medians[flavour] - served
            lines.append(
                f"| {batch} | {entry['ids_per_call']:.0f} | {served:.0f} | {flavour} | "
                f"{_cell([run['calls_per_s'] for run in runs], '.0f')} | {_cell(cpu, '.0f')} | "
                f"{statistics.median(run['system_us_per_call'] for run in runs):.0f} | {machinery:.0f} | "
                f"{machinery / work:.2f}x | {sum(run['errors'] for run in runs)} |")
        if KEPT in medians:
            summary[f"machinery_over_tensor_work_b{batch}"] = (medians[KEPT] - work) / work
            if "aio-pool-protobuf" in medians:
                summary[f"cpu_ratio_before_over_kept_b{batch}"] = medians["aio-pool-protobuf"] / medians[KEPT]
        if NULL in medians:
            summary[f"grpc_floor_over_tensor_work_b{batch}"] = medians[NULL] / work
        serving = {name: cpu for name, cpu in medians.items() if name != NULL}
        lines.append(f"| {batch} | | | cheapest serving rows: {min(serving, key=serving.get)} | | | | | | |")
    lines += ["", f"The product's shard server runs `{KEPT}` (summary keys `machinery_over_tensor_work_b<batch>`, "
              "`cpu_ratio_before_over_kept_b<batch>`: `aio-pool-protobuf` over it); "
              f"`grpc_floor_over_tensor_work_b<batch>` is `{NULL}`'s CPU over the tensor work."]
    return "\n".join(lines), summary


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="criteo-kaggle")
    parser.add_argument("--num-shards", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256, 2048])
    parser.add_argument("--flavours", nargs="+", default=list(FLAVOURS), choices=FLAVOURS)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=2, help="calls outstanding (two dense batches in flight)")
    parser.add_argument("--sync-threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32, help="distinct lookups per batch size")
    parser.add_argument("--work-calls", type=int, default=300, help="calls timed for the tensor work")
    parser.add_argument("--name", default="bench_shard_server", help="results file name")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the result files")
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    results = measure(args)
    table, summary = report(args, results)
    print(table)
    write_results(args.name, {**provenance(), "machine": machine(), "args": vars(args),
                              "summary": summary, "rows": results}, table, args.out)


if __name__ == "__main__":
    main()
