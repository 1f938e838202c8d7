"""gRPC server hosting one table-wise shard of a model's embedding tables (DESIGN.md §4).

The shard's module runs in a small thread pool under ``torch.inference_mode`` so the event loop keeps answering
health checks and rejecting bad requests while a lookup computes. Bad requests get INVALID_ARGUMENT naming the
problem and never take the server down. Standalone::

    python -m disagg.embedding_server --preset tiny --seed 0 --shard 0 --num-shards 2 --port 50051
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from disagg import tensor_wire
from disagg._proto import embedding_pb2 as pb
from disagg._proto import embedding_pb2_grpc as pb_grpc
from serving.common.device import set_torch_threads
from serving.common.logging import get_logger

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EmbeddingShard"].full_name
MiB = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB

logger = get_logger("disagg.embedding_server")


class Shard(Protocol):
    """What the server hosts; ``disagg.partition.EmbeddingShard`` is one."""

    @property
    def index(self) -> int: ...
    @property
    def module(self) -> Any: ...  # called as module(**inputs) -> dict[str, Tensor] keyed by output_names
    @property
    def input_names(self) -> tuple[str, ...]: ...
    @property
    def output_names(self) -> tuple[str, ...]: ...
    @property
    def parameter_bytes(self) -> int: ...


class _Servicer(pb_grpc.EmbeddingShardServicer):
    def __init__(self, shard: Shard, info: pb.ShardInfo, pool: ThreadPoolExecutor, max_elements: int) -> None:
        self._shard = shard
        self._info = info
        self._pool = pool
        self._max_elements = max_elements
        self._expected = frozenset(shard.input_names)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.ShardInfo:
        return self._info

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the lookup started")
        try:
            inputs = tensor_wire.decode_all(request.inputs, max_elements=self._max_elements)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if problem := self._name_problem(inputs.keys()):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # A call that ends (deadline, cancellation) while queued for a worker is dropped from the queue.
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(self._pool, self._run, inputs)
        except Exception as error:  # out-of-range ids, wrong shapes or dtypes: the request's fault
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"shard {self._shard.index}: {error}")
        try:
            selected = {name: outputs[name] for name in self._shard.output_names}
            return pb.LookupResponse(outputs=tensor_wire.encode_all(selected, max_elements=self._max_elements))
        except (KeyError, TypeError, ValueError) as error:  # the module broke its contract, not the request
            await context.abort(grpc.StatusCode.INTERNAL, f"shard {self._shard.index} output: {error!r}")

    def _name_problem(self, names: Iterable[str]) -> str | None:
        missing = sorted(self._expected - set(names))
        unknown = sorted(set(names) - self._expected)
        if not missing and not unknown:
            return None
        parts = [f"missing input {name!r}" for name in missing] + [f"unknown input {name!r}" for name in unknown]
        return f"shard {self._shard.index}: {'; '.join(parts)}; expected inputs: {', '.join(self._shard.input_names)}"

    def _run(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        with torch.inference_mode():
            return self._shard.module(**inputs)


class EmbeddingServer:
    """One shard served over ``grpc.aio`` with health checking; loopback unless ``host`` says otherwise."""

    def __init__(
        self,
        shard: Shard,
        *,
        model: str = "",
        num_shards: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_tensor_elements: int = tensor_wire.DEFAULT_MAX_ELEMENTS,
        worker_threads: int = 2,
        torch_threads: int | None = None,
    ) -> None:
        self._shard = shard
        self._info = pb.ShardInfo(
            model=model,
            shard_index=shard.index,
            num_shards=num_shards,
            input_names=shard.input_names,
            output_names=shard.output_names,
            parameter_bytes=shard.parameter_bytes,
        )
        self._host = host
        self._port = port
        self._max_message_bytes = max_message_bytes
        self._max_tensor_elements = max_tensor_elements
        self._worker_threads = worker_threads
        self._torch_threads = torch_threads
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def address(self) -> str:
        """``host:port`` as bound; only meaningful after ``start``."""
        return f"{self._host}:{self._port}"

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (the chosen one when ``port`` was 0)."""
        set_torch_threads(self._torch_threads)
        self._pool = ThreadPoolExecutor(self._worker_threads, thread_name_prefix=f"embedding-shard-{self._shard.index}")
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", self._max_message_bytes),
            ]
        )
        servicer = _Servicer(self._shard, self._info, self._pool, self._max_tensor_elements)
        pb_grpc.add_EmbeddingShardServicer_to_server(servicer, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._port = self._server.add_insecure_port(f"{self._host}:{self._port}")
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self._port

    async def stop(self, grace: float | None = 1.0, *, drain_s: float = 0.0) -> None:
        """Report NOT_SERVING, keep serving ``drain_s`` seconds so health-checking balancers move away,
        then refuse new calls and give in-flight ones ``grace`` seconds to finish."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await asyncio.sleep(drain_s)
        await self._server.stop(grace)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._server = None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Serve one table-wise embedding shard of a DLRM preset over gRPC.")
    parser.add_argument("--preset", default="tiny", help="DLRM preset (disagg.model.PRESETS)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the deterministic weight initialisation")
    parser.add_argument("--shard", type=int, required=True, help="index of the shard to serve")
    parser.add_argument("--num-shards", type=int, required=True, help="number of shards the tables are split into")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=50051, help="port to bind; 0 picks a free one")
    parser.add_argument("--max-message-mb", type=int, default=DEFAULT_MAX_MESSAGE_BYTES // MiB)
    parser.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    from disagg.model import preset_spec
    from disagg.partition import build_embedding_shard

    shard = build_embedding_shard(preset_spec(args.preset), args.seed, args.shard, args.num_shards)
    server = EmbeddingServer(
        shard,
        model=args.preset,
        num_shards=args.num_shards,
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_mb * MiB,
        torch_threads=args.torch_threads,
    )
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    logger.info(
        "serving %s shard %d/%d on %s: outputs %s from inputs %s; %d parameter bytes",
        args.preset, shard.index, args.num_shards, server.address,
        ", ".join(shard.output_names), ", ".join(shard.input_names), shard.parameter_bytes,
    )  # fmt: skip
    await stopping.wait()
    logger.info("stopping shard %d on %s", shard.index, server.address)
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
