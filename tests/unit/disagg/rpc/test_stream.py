"""Packed lookups on a ``LookupStream`` against a real table shard on loopback: the same rows as ``Lookup`` calls,
concurrent lookups sharing one stream, refusals that leave the stream open, and failover, deadlines and the token
as for calls."""

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from disagg.model_source import PresetSource
from disagg.rpc import packed
from disagg.rpc.client import EmbeddingRequestError, ShardClient, ShardUnavailable
from disagg.rpc.server import EmbeddingServer
from disagg.rpc.wire import SERVICE_NAME
from disagg.tables import TableLayout, build_embedding_shard
from tests.helpers.embedding_shards import serving

LAYOUT = TableLayout(2, row_wise_min_bytes=32768)
TOKEN = "stream-test-token"


@pytest.fixture(scope="module")
def shard():
    return build_embedding_shard(PresetSource("tiny", 0), 0, LAYOUT)


class SlowGather:
    """A table shard's module whose ``gather`` takes ``delay_s`` longer (``Shard.module`` for the server)."""

    def __init__(self, module, delay_s: float) -> None:
        self._module, self.delay_s = module, delay_s
        self.widths = module.widths

    def gather(self, ids, dtype):
        time.sleep(self.delay_s)
        return self._module.gather(ids, dtype)

    def __call__(self, **inputs):
        return self._module(**inputs)


@dataclass(frozen=True)
class SlowShard:
    """A table shard served with a ``SlowGather`` module (``disagg.rpc.server.Shard``)."""

    index: int
    module: Any
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    parameter_bytes: int
    version: str


def ids_for(shard, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {piece.name: torch.randint(0, piece.rows, (3 + seed % 4,), generator=generator, dtype=torch.int32)
            for piece in shard.slices}


def client_for(shard, addresses, *, stream: bool = True, **options) -> ShardClient:
    return ShardClient(0, addresses, input_names=shard.input_names, packed=True, stream=stream, **options)


@contextlib.asynccontextmanager
async def closing(*clients):
    try:
        yield clients
    finally:
        for client in clients:
            await client.close()


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_concurrent_lookups_share_one_stream_and_get_the_rows_calls_get(shard):
    async def body():
        async with (serving(shard, model="tiny", num_shards=2) as server,
                    closing(client_for(shard, [server.address]),
                            client_for(shard, [server.address], stream=False)) as (streamed, called)):
            requests = [ids_for(shard, seed) for seed in range(8)]
            got = await asyncio.gather(*(streamed.lookup(ids, timeout_s=10, output_dtype="float16")
                                         for ids in requests))
            expected = [await called.lookup(ids, timeout_s=10, output_dtype="float16") for ids in requests]
            stream = streamed._channel(server.address).stream
            assert stream._call is not None  # the lookups went on the stream, which stays open for the next
            assert not stream._pending
        for ours, theirs in zip(got, expected, strict=True):
            assert_same(ours, theirs)
        assert streamed.stats.calls == 8 and streamed.stats.failovers == 0

    asyncio.run(body())


def test_a_refused_lookup_is_a_request_error_and_the_stream_goes_on(shard):
    async def body():
        async with (serving(shard, model="tiny", num_shards=2) as server,
                    closing(client_for(shard, [server.address])) as (client,)):
            good = ids_for(shard, 1)
            await client.lookup(good, timeout_s=5)
            call = client._channel(server.address).stream._call
            bad = {**good, shard.slices[0].name: torch.tensor([shard.slices[0].rows], dtype=torch.int32)}
            with pytest.raises(EmbeddingRequestError) as refused:
                await client.lookup(bad, timeout_s=5)
            again = await client.lookup(good, timeout_s=5)
            assert client._channel(server.address).stream._call is call  # the same stream answered after the refusal
        assert refused.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
        assert "is out of range" in refused.value.details
        assert client.stats.failovers == 0 and client.stats.request_errors == 1
        assert again.keys() == good.keys()

    asyncio.run(body())


def test_a_stopped_replica_fails_its_stream_over_to_another(shard):
    async def body():
        async with serving(shard, model="tiny", num_shards=2) as alive:
            doomed = EmbeddingServer(shard, model="tiny", num_shards=2)
            await doomed.start()
            async with closing(client_for(shard, [doomed.address, alive.address], cooldown_s=60)) as (client,):
                ids = ids_for(shard, 2)
                first = await client.lookup(ids, timeout_s=5)  # round robin starts at the doomed replica
                await doomed.stop(0)
                for _ in range(4):
                    assert_same(await client.lookup(ids, timeout_s=5), first)
        assert client.stats.failovers == 1 and client.stats.unavailable == 0

    asyncio.run(body())


def test_a_late_reply_is_deadline_exceeded_then_dropped_and_the_stream_still_answers(shard):
    slow = SlowShard(shard.index, SlowGather(shard.module, delay_s=0.6), shard.input_names, shard.output_names,
                     shard.parameter_bytes, shard.version)

    async def body():
        async with (serving(slow, model="tiny", num_shards=2, inline_max_ids=0) as server,
                    closing(client_for(slow, [server.address])) as (client,)):
            ids = ids_for(shard, 3)
            with pytest.raises(ShardUnavailable) as late:
                await client.lookup(ids, timeout_s=0.2)
            answered = await client.lookup(ids, timeout_s=5)  # the late reply arrives first and is dropped
        assert "DEADLINE_EXCEEDED" in late.value.last_error
        assert answered.keys() == ids.keys()

    asyncio.run(body())


def test_a_stream_without_the_token_is_refused_and_the_client_fails_over_to_a_replica_accepting_it(shard):
    async def body():
        async with (serving(shard, model="tiny", num_shards=2, token="old-token") as old,
                    serving(shard, model="tiny", num_shards=2, token=TOKEN) as new,
                    closing(client_for(shard, [old.address, new.address], token=TOKEN, cooldown_s=60)) as (client,)):
            await client.lookup(ids_for(shard, 4), timeout_s=5)
            await client.lookup(ids_for(shard, 5), timeout_s=5)
        assert client.stats.failovers == 1 and client.stats.unavailable == 0

    asyncio.run(body())


def test_bytes_that_are_no_packed_request_end_the_stream_with_invalid_argument(shard):
    async def body():
        async with (serving(shard, model="tiny", num_shards=2) as server,
                    grpc.aio.insecure_channel(server.address) as channel):
            call = channel.stream_stream(f"/{SERVICE_NAME}/LookupStream")()
            await call.write(b"\xff\xfe not a message")
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed LookupRequest" in ended.value.details()

    asyncio.run(body())


def test_sequence_status_and_error_round_trip_and_a_refusal_needs_a_status():
    ids = torch.arange(5, dtype=torch.int32)
    request = packed.parse_request(packed.encode_request(ids, [2, 3], "float16", sequence=7))
    assert request.sequence == 7 and request.counts == [2, 3] and torch.equal(request.ids, ids)
    reply = packed.encode_reply(torch.ones(6), [3], "v1", sequence=7)
    assert packed.stream_header(reply) == packed.StreamHeader(7, 0, "")
    assert packed.parse_reply(reply).widths == [3]
    refusal = packed.encode_refusal(9, grpc.StatusCode.INVALID_ARGUMENT.value[0], "id 12 is out of range")
    assert packed.stream_header(refusal) == packed.StreamHeader(9, 3, "id 12 is out of range")
    with pytest.raises(ValueError, match="non-zero gRPC status"):
        packed.encode_refusal(1, 0, "")
