"""EmbeddingServer on loopback: lookups, output dtypes, versions, refusals that leave it serving, deadlines, health,
message limits, the in-flight count."""

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg.model_source import PresetSource
from disagg.rpc import wire
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc._proto import embedding_pb2_grpc as pb_grpc
from disagg.rpc.server import SERVICE_NAME, EmbeddingServer, _Servicer
from tests.helpers import REPO
from tests.helpers.embedding_shards import Gate, ToyShard, serving, toy_inputs, toy_shard

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: A drain long enough for a few loopback calls on a loaded machine.
DRAIN_S = 5.0
ROOT = REPO


@contextlib.asynccontextmanager
async def stub_for(server: EmbeddingServer, **options):
    async with grpc.aio.insecure_channel(server.address, options=list(options.items())) as channel:
        yield pb_grpc.EmbeddingShardStub(channel), health_pb2_grpc.HealthStub(channel)


def lookup_request(inputs: dict[str, torch.Tensor], output_dtype: str = "") -> pb.LookupRequest:
    return pb.LookupRequest(inputs=wire.encode_all(inputs), output_dtype=output_dtype)


async def health_status(health, service: str):
    """The service's health status, polled until it is NOT_SERVING (for at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        status = (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)).status
        if status == NOT_SERVING or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.02)


async def assert_still_serves(stub, shard: ToyShard) -> None:
    response = await stub.Lookup(lookup_request(toy_inputs(shard)), timeout=5)
    assert [t.name for t in response.outputs] == list(shard.output_names)


def test_info_and_loopback_address():
    async def body():
        shard = toy_shard(index=1, version="v-info")
        async with serving(shard, model="toy", num_shards=3) as server, stub_for(server) as (stub, _):
            assert server.address.startswith("127.0.0.1:") and not server.address.endswith(":0")
            info = await stub.Info(pb.InfoRequest(), timeout=5)
        assert (info.model, info.shard_index, info.num_shards, info.version) == ("toy", 1, 3, "v-info")
        assert tuple(info.input_names) == ("ids_a", "ids_b") and tuple(info.output_names) == ("pooled_a", "pooled_b")
        assert info.parameter_bytes == shard.parameter_bytes == 2 * 10 * 4 * 4

    asyncio.run(body())


def test_lookup_equals_calling_the_module_and_carries_the_version():
    async def body():
        shard = toy_shard(version="v-lookup")
        inputs = {"ids_a": torch.tensor([0, 9, 3]), "ids_b": torch.tensor([5, 5, 1])}
        async with serving(shard) as server, stub_for(server) as (stub, _):
            response = await stub.Lookup(lookup_request(inputs), timeout=5)
        assert response.version == "v-lookup"
        outputs = wire.decode_all(response.outputs)
        expected = shard.module(**inputs)
        assert outputs.keys() == expected.keys()
        for name, tensor in expected.items():
            assert outputs[name].dtype == torch.float32
            torch.testing.assert_close(outputs[name], tensor, rtol=0, atol=0)

    asyncio.run(body())


@pytest.mark.parametrize("output_dtype", ["float16", "bfloat16", "float32"])
def test_output_dtype_casts_the_float32_rows(output_dtype):
    async def body():
        shard = toy_shard()
        inputs = {"ids_a": torch.tensor([0, 9, 3]), "ids_b": torch.tensor([5, 5, 1])}
        async with serving(shard) as server, stub_for(server) as (stub, _):
            full = await stub.Lookup(lookup_request(inputs), timeout=5)
            cast = await stub.Lookup(lookup_request(inputs, output_dtype), timeout=5)
        assert cast.version == full.version == shard.version
        dtype = getattr(torch, output_dtype)
        expected = {name: tensor.to(dtype) for name, tensor in wire.decode_all(full.outputs).items()}
        outputs = wire.decode_all(cast.outputs)
        assert outputs.keys() == expected.keys()
        for name, tensor in expected.items():
            assert outputs[name].dtype == tensor.dtype
            assert torch.equal(outputs[name], tensor)

    asyncio.run(body())


@pytest.mark.parametrize("output_dtype", ["int8", "float64", "FLOAT16"])
def test_unknown_output_dtype_is_invalid_argument_naming_the_field_and_never_computed(output_dtype):
    async def body():
        shard = toy_shard()
        async with serving(shard) as server, stub_for(server) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Lookup(lookup_request(toy_inputs(shard), output_dtype), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = info.value.details()
            assert "output_dtype" in details and repr(output_dtype) in details
            assert all(allowed in details for allowed in ("float32", "float16", "bfloat16"))
            await assert_still_serves(stub, shard)
        assert shard.module.calls == 1

    asyncio.run(body())


def test_lookups_in_flight_counts_calls_until_answered_or_refused():
    async def body():
        shard = toy_shard()
        gate = Gate(shard.module)
        gated = replace(shard, module=gate)
        server = EmbeddingServer(gated)
        assert server.lookups_in_flight == 0
        await server.start()
        try:
            async with stub_for(server) as (stub, _):
                pending = asyncio.ensure_future(stub.Lookup(lookup_request(toy_inputs(shard)), timeout=10))
                assert await asyncio.to_thread(gate.entered.wait, 10)
                assert server.lookups_in_flight == 1
                gate.release.set()
                await pending
                assert server.lookups_in_flight == 0
                for request in (
                    lookup_request({"ids_a": torch.zeros(1, dtype=torch.int64)}),
                    lookup_request(toy_inputs(shard), output_dtype="int8"),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.Lookup(request, timeout=5)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert server.lookups_in_flight == 0
                await stub.Info(pb.InfoRequest(), timeout=5)
                assert server.lookups_in_flight == 0
        finally:
            await server.stop(0)
        assert shard.module.calls == 1

    asyncio.run(body())


@pytest.mark.parametrize(
    ("inputs", "problems"),
    [
        ({"ids_a": torch.zeros(2, dtype=torch.int64)}, ["missing input 'ids_b'"]),
        (
            {"ids_a": torch.zeros(2, dtype=torch.int64), "idz_b": torch.zeros(2, dtype=torch.int64)},
            ["missing input 'ids_b'", "unknown input 'idz_b'"],
        ),
    ],
)
def test_wrong_input_names_are_invalid_argument_naming_them(inputs, problems):
    async def body():
        shard = toy_shard()
        async with serving(shard) as server, stub_for(server) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Lookup(lookup_request(inputs), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for problem in problems:
                assert problem in info.value.details()
            await assert_still_serves(stub, shard)
        assert shard.module.calls == 1  # the refused request never reached the module

    asyncio.run(body())


@pytest.mark.parametrize(
    ("tensor", "detail"),
    [
        (pb.Tensor(name="ids_a", dtype="int64", shape=[2], data=bytes(3)), "tensor 'ids_a': data holds 3 bytes"),
        (pb.Tensor(name="ids_a", dtype="complex64", shape=[1], data=bytes(8)), "unknown dtype 'complex64'"),
    ],
)
def test_malformed_tensor_is_invalid_argument(tensor, detail):
    async def body():
        shard = toy_shard()
        request = pb.LookupRequest(inputs=[tensor, wire.encode("ids_b", torch.zeros(2, dtype=torch.int64))])
        async with serving(shard) as server, stub_for(server) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Lookup(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert detail in info.value.details()
            await assert_still_serves(stub, shard)

    asyncio.run(body())


def test_out_of_range_ids_are_invalid_argument_and_the_server_keeps_serving():
    async def body():
        shard = toy_shard(rows=10)
        inputs = {"ids_a": torch.tensor([0, 10]), "ids_b": torch.tensor([0, 1])}
        async with serving(shard) as server, stub_for(server) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Lookup(lookup_request(inputs), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("shard 0: ") and "index" in info.value.details().lower()
            await assert_still_serves(stub, shard)

    asyncio.run(body())


def test_traffic_counts_the_bytes_of_answered_lookups_and_not_of_refused_ones():
    async def body():
        shard = toy_shard(rows=10)
        good = lookup_request({"ids_a": torch.tensor([0, 9, 3]), "ids_b": torch.tensor([5, 5, 1])})
        refused = lookup_request({"ids_a": torch.tensor([0, 10]), "ids_b": torch.tensor([0, 1])})
        async with serving(shard) as server, stub_for(server) as (stub, _):
            assert server.traffic == (0, 0)
            first = await stub.Lookup(good, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Lookup(refused, timeout=5)
            second = await stub.Lookup(good, timeout=5)
            assert server.traffic == (2 * good.ByteSize(), first.ByteSize() + second.ByteSize())

    asyncio.run(body())


def test_module_breaking_its_output_contract_is_internal():
    async def body():
        shard = toy_shard()
        broken = ToyShard(0, shard.module, shard.input_names, ("pooled_a", "pooled_c"), shard.parameter_bytes)
        async with serving(broken) as server, stub_for(server) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Lookup(lookup_request(toy_inputs(shard)), timeout=5)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "pooled_c" in info.value.details()

    asyncio.run(body())


def test_oversized_request_is_resource_exhausted_and_the_server_keeps_serving():
    async def body():
        shard = toy_shard()
        big = {"ids_a": torch.zeros(300_000, dtype=torch.int64), "ids_b": torch.zeros(1, dtype=torch.int64)}
        async with (
            serving(shard, max_message_bytes=1 << 20) as server,
            stub_for(server, **{"grpc.max_send_message_length": 8 << 20}) as (stub, _),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Lookup(lookup_request(big), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await assert_still_serves(stub, shard)
        assert shard.module.calls == 1

    asyncio.run(body())


def test_message_limit_is_raised_above_grpc_default_of_4_mib():
    async def body():
        shard = toy_shard()
        inputs = {"ids_a": torch.zeros(1_000_000, dtype=torch.int64), "ids_b": torch.zeros(1, dtype=torch.int64)}
        options = {"grpc.max_send_message_length": 64 << 20, "grpc.max_receive_message_length": 64 << 20}
        async with serving(shard) as server, stub_for(server, **options) as (stub, _):
            response = await stub.Lookup(lookup_request(inputs), timeout=60)  # 8 MB in, 16 MB out
        assert wire.decode_all(response.outputs)["pooled_a"].shape == (1_000_000, 4)

    asyncio.run(body())


def test_health_serving_then_not_serving_while_draining():
    async def body():
        shard = toy_shard()
        server = EmbeddingServer(shard)
        await server.start()
        async with stub_for(server) as (stub, health):
            for service in ("", SERVICE_NAME):
                response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert response.status == SERVING
            stopping = asyncio.create_task(server.stop(0, drain_s=DRAIN_S))
            for service in ("", SERVICE_NAME):  # NOT_SERVING at once: the drain's first step
                assert await health_status(health, service) == NOT_SERVING
            await assert_still_serves(stub, shard)  # draining: still answers those that come
            assert not stopping.done()
            await stopping
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


def test_health_checks_answer_while_a_lookup_computes():
    """A health check answers while a lookup is held in the module (``Gate``): it never waits behind one."""
    async def body():
        shard = toy_shard()
        gate = Gate(shard.module)
        async with serving(replace(shard, module=gate)) as server, stub_for(server) as (stub, health):
            lookup = asyncio.ensure_future(stub.Lookup(lookup_request(toy_inputs(shard)), timeout=60))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            response = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
            assert response.status == SERVING
            assert not gate.left.is_set() and not lookup.done()
            gate.release.set()
            await lookup

    asyncio.run(body())


def test_slow_lookup_gets_deadline_exceeded_and_queued_expired_ones_are_not_computed():
    """With one worker held by a lookup (``Gate``), the next one expires in the queue and is never computed: the
    lookup after it, served in order behind it, is the module's second call."""
    async def body():
        shard = toy_shard()
        gate = Gate(shard.module)
        async with serving(replace(shard, module=gate), worker_threads=1) as server, stub_for(server) as (stub, _):
            first = asyncio.ensure_future(stub.Lookup(lookup_request(toy_inputs(shard)), timeout=60))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            with pytest.raises(grpc.aio.AioRpcError) as info:  # waits behind ``first``, expires in the queue
                await stub.Lookup(lookup_request(toy_inputs(shard)), timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gate.release.set()
            await first
            await assert_still_serves(stub, shard)
            assert shard.module.calls == 2

    asyncio.run(body())


class _ExpiredContext:
    def time_remaining(self) -> float:
        return 0.0

    async def abort(self, code, details):
        raise grpc.aio.AbortError(f"{code.name}: {details}")


def test_request_whose_deadline_has_passed_is_not_computed():
    async def body():
        shard = toy_shard()
        with ThreadPoolExecutor(1) as pool:
            servicer = _Servicer(shard, pb.ShardInfo(), pool, max_elements=100)
            with pytest.raises(grpc.aio.AbortError, match="DEADLINE_EXCEEDED"):
                await servicer.Lookup(lookup_request(toy_inputs(shard)), _ExpiredContext())
        assert shard.module.calls == 0

    asyncio.run(body())


def test_stop_is_idempotent_and_stops_serving():
    async def body():
        server = EmbeddingServer(toy_shard())
        await server.start()
        address = server.address
        await server.stop(0)
        await server.stop(0)
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.EmbeddingShardStub(channel).Info(pb.InfoRequest(), timeout=1)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


@pytest.mark.slow
def test_standalone_server_serves_its_preset_shard_and_exits_cleanly_on_sigterm():
    from disagg.tables import TableLayout, build_embedding_shard

    command = [sys.executable, "-m", "disagg.rpc.server", "--preset", "tiny", "--seed", "3", "--shard", "1"]
    command += ["--num-shards", "2", "--row-wise-min-mb", "0.03", "--storage-dtype", "int8", "--port", "0"]
    command += ["--torch-threads", "1"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = next((line for line in process.stderr if "serving" in line), "")
        match = re.search(r"serving tiny shard 1/2 on (127\.0\.0\.1:\d+) \(plaintext\): version (\w+), ", line)
        assert match, f"no serving line, process exited with {process.poll()}"
        layout = TableLayout(2, row_wise_min_bytes=int(0.03 * 2**20), storage_dtype="int8")
        expected_shard = build_embedding_shard(PresetSource("tiny", 3), 1, layout)
        assert any("[" in name for name in expected_shard.input_names)  # some tables split row-wise
        inputs = {piece.name: torch.arange(piece.rows, dtype=torch.int32) % 7 for piece in expected_shard.slices}

        async def lookup():
            async with grpc.aio.insecure_channel(match.group(1)) as channel:
                stub = pb_grpc.EmbeddingShardStub(channel)
                info = await stub.Info(pb.InfoRequest(), timeout=10)
                return info, await stub.Lookup(lookup_request(inputs), timeout=10)

        info, response = asyncio.run(lookup())
        assert (info.model, info.shard_index, info.num_shards) == ("tiny", 1, 2)
        assert info.version == response.version == match.group(2) == expected_shard.version
        assert tuple(info.output_names) == expected_shard.output_names
        outputs = wire.decode_all(response.outputs)
        expected = expected_shard.module(**inputs)
        for name in expected_shard.output_names:
            torch.testing.assert_close(outputs[name], expected[name], rtol=0, atol=0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert "stopping shard 1" in process.stderr.read()
    finally:
        process.kill()
        process.wait()
