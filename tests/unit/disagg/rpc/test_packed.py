"""Packed lookups (one ids tensor in, one rows tensor out) against a real table shard on loopback: equal to named
lookups, malformed ones refused naming the field, a shard that cannot reply packed is an internal error."""

import asyncio
from dataclasses import replace

import grpc
import pytest
import torch

from disagg.model_source import PresetSource
from disagg.rpc import wire
from disagg.rpc._proto import embedding_pb2 as pb
from disagg.rpc.client import ShardClient, ShardUnavailable
from disagg.tables import TableLayout, build_embedding_shard
from tests.helpers.embedding_shards import serving, toy_inputs, toy_shard
from tests.unit.disagg.rpc.test_server import stub_for

LAYOUT = TableLayout(2, row_wise_min_bytes=32768)  # tiny: its 1000-row tables split over both shards


@pytest.fixture(scope="module")
def shard():
    return build_embedding_shard(PresetSource("tiny", 0), 0, LAYOUT)


def local_ids(shard, seed: int) -> dict[str, torch.Tensor]:
    """Ids for every slice of ``shard``, the second slice left without any."""
    generator = torch.Generator().manual_seed(seed)
    return {piece.name: torch.randint(0, piece.rows, (0 if at == 1 else 5 + at,), generator=generator,
                                      dtype=torch.int32)
            for at, piece in enumerate(shard.slices)}


@pytest.mark.parametrize("output_dtype", ["", "float16", "bfloat16"])
def test_packed_lookup_returns_what_a_named_lookup_returns(shard, output_dtype: str) -> None:
    async def body():
        async with serving(shard, model="tiny", num_shards=2) as server:
            names = shard.input_names
            packed = ShardClient(0, [server.address], input_names=names, packed=True)
            named = ShardClient(0, [server.address], input_names=names)
            try:
                ids = local_ids(shard, seed=1)
                got = await packed.lookup(ids, timeout_s=10, output_dtype=output_dtype)
                expected = await named.lookup(ids, timeout_s=10, output_dtype=output_dtype)
            finally:
                await packed.close()
                await named.close()
        assert list(got) == list(names)
        for name in names:
            assert got[name].dtype == wire.ROW_DTYPES[output_dtype], name
            assert torch.equal(got[name], expected[name]), name
        assert got[names[1]].shape == (0, shard.slices[1].dim)

    asyncio.run(body())


def packed_request(shard, change: str) -> pb.LookupRequest:
    ids = local_ids(shard, seed=2)
    flat = torch.cat(list(ids.values()))
    counts = [tensor.numel() for tensor in ids.values()]
    if change == "counts short":
        counts = counts[:-1]
    elif change == "counts sum":
        counts[0] += 1
    elif change == "negative count":
        counts[0], counts[2] = -1, counts[2] + counts[0] + 1
    elif change == "2-D ids":
        flat = flat.reshape(1, -1)
    elif change == "float ids":
        flat = flat.to(torch.float32)
    elif change == "id past its slice":
        flat[0] = shard.slices[0].rows
    request = pb.LookupRequest(ids=wire.encode("ids", flat), counts=counts)
    if change == "inputs too":
        request.inputs.append(wire.encode(shard.input_names[0], ids[shard.input_names[0]]))
    return request


@pytest.mark.parametrize(("change", "detail"), [
    ("counts short", "counts must give the ids of each of the"),
    ("counts sum", "add up to the"),
    ("negative count", "`counts` holds a negative value"),
    ("2-D ids", "packed ids must be 1-D"),
    ("inputs too", "a packed request (ids, counts) carries no `inputs`"),
    ("float ids", "ids must be a 1-D int32 or int64 tensor, got float32"),
    ("id past its slice", "is out of range; valid ids are [0,"),
])
def test_malformed_packed_requests_are_invalid_argument_and_the_shard_keeps_serving(shard, change, detail) -> None:
    async def body():
        async with serving(shard, model="tiny", num_shards=2) as server, stub_for(server) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Lookup(packed_request(shard, change), timeout=5)
            good = await stub.Lookup(packed_request(shard, "none"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert detail in refused.value.details()
        assert list(good.widths) == [piece.dim for piece in shard.slices]

    asyncio.run(body())


def test_a_shard_without_one_row_per_id_cannot_reply_packed() -> None:
    toy = toy_shard()
    padded = replace(toy, module=lambda **ids: {name: torch.zeros(2, 4) for name in toy.output_names})

    async def body():
        async with serving(padded, model="toy", num_shards=1) as server:
            client = ShardClient(0, [server.address], input_names=toy.input_names, packed=True)
            try:
                with pytest.raises(ShardUnavailable) as failed:  # the replica is at fault, as for any INTERNAL
                    await client.lookup(toy_inputs(toy, batch=3), timeout_s=5)
            finally:
                await client.close()
        assert "INTERNAL" in failed.value.last_error
        assert "packed replies need output 'pooled_a' to be [3, width], got [2, 4]" in failed.value.last_error

    asyncio.run(body())
