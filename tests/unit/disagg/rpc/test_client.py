"""ShardClient / EmbeddingClient against real servers on loopback: fan-out, failover, deadlines, refusals."""

import asyncio
import contextlib
import pickle
from dataclasses import replace

import grpc
import pytest
import torch

from disagg.rpc.client import (
    EmbeddingClient,
    EmbeddingRequestError,
    ShardClient,
    ShardUnavailable,
    ShardVersionMismatch,
)
from disagg.rpc.server import EmbeddingServer
from serving.common.errors import APIError
from tests.helpers.embedding_shards import Gate, ToyShard, serving, toy_inputs, toy_shard


@contextlib.asynccontextmanager
async def closing(client):
    try:
        yield client
    finally:
        await client.close()


async def dead_address() -> str:
    """An address that refuses connections: a server's, after it stopped."""
    server = EmbeddingServer(toy_shard())
    await server.start()
    await server.stop(0)
    return server.address


def gated(shard: ToyShard) -> ToyShard:
    """``shard`` with its module behind a ``Gate``: a lookup waits there until the test releases it."""
    return replace(shard, module=Gate(shard.module))


def assert_same(outputs: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert outputs.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(outputs[name], tensor, rtol=0, atol=0)


def test_round_trip_over_two_shards_equals_calling_the_modules():
    async def body():
        first, second = toy_shard(0, ("a", "b")), toy_shard(1, ("c",))
        inputs = {"ids_a": torch.tensor([1, 2]), "ids_b": torch.tensor([3, 4]), "ids_c": torch.tensor([9, 0])}
        async with serving(first) as s0, serving(second) as s1:
            shards = [ShardClient(0, [s0.address]), ShardClient(1, [s1.address])]
            async with closing(EmbeddingClient(shards)) as client:
                outputs = await client.lookup(inputs, timeout_s=5)
                assert_same(await client.lookup(inputs, timeout_s=5), outputs)
        expected = first.module(ids_a=inputs["ids_a"], ids_b=inputs["ids_b"]) | second.module(ids_c=inputs["ids_c"])
        assert_same(outputs, expected)
        assert [shard.input_names for shard in shards] == [("ids_a", "ids_b"), ("ids_c",)]  # learned via Info
        assert client.stats.calls == 2 and len(client.stats.recent_latencies_s) == 2
        assert shards[0].stats.failovers == 0

    asyncio.run(body())


def test_shards_are_looked_up_concurrently():
    """Both shards are asked while neither may answer (each held at its gate): one at a time would wait forever."""
    async def body():
        first, second = gated(toy_shard(0, ("a",))), gated(toy_shard(1, ("b",)))
        async with serving(first) as s0, serving(second) as s1:
            shards = [ShardClient(0, [s0.address], input_names=["ids_a"]), ShardClient(1, [s1.address])]
            async with closing(EmbeddingClient(shards)) as client:
                inputs = {"ids_a": torch.tensor([1]), "ids_b": torch.tensor([2])}
                lookup = asyncio.ensure_future(client.lookup(inputs, timeout_s=60))
                for shard in (first, second):
                    assert await asyncio.to_thread(shard.module.entered.wait, 30), "shards asked one at a time"
                for shard in (first, second):
                    shard.module.release.set()
                outputs = await lookup
        assert outputs.keys() == {"pooled_a", "pooled_b"}

    asyncio.run(body())


def test_lookups_fail_over_when_a_replica_stops_and_skip_it_while_it_cools_down():
    async def body():
        shard = toy_shard()
        expected = shard.module(**toy_inputs(shard))
        async with serving(shard) as alive:
            doomed = EmbeddingServer(shard)
            await doomed.start()
            async with closing(ShardClient(0, [doomed.address, alive.address], cooldown_s=60)) as client:
                assert_same(await client.lookup(toy_inputs(shard), timeout_s=5), expected)
                await doomed.stop(0)
                for _ in range(6):
                    assert_same(await client.lookup(toy_inputs(shard), timeout_s=5), expected)
                assert client.stats.failovers == 1  # then the stopped replica cools down, tried last
                assert client.stats.unavailable == 0

    asyncio.run(body())


def test_slow_replica_leaves_time_to_fail_over_to_a_fast_one():
    """A replica that never answers (held at its gate) takes half the deadline; the other answers in the rest."""
    async def body():
        hung, fast = gated(toy_shard()), toy_shard()
        async with (
            serving(hung) as s_hung,
            serving(fast) as s_fast,
            closing(ShardClient(0, [s_hung.address, s_fast.address])) as client,
        ):
            for _ in range(2):  # round robin: one of the two starts on the hung replica
                await client.lookup(toy_inputs(fast), timeout_s=4)
            hung.module.release.set()
        assert client.stats.failovers == 1 and hung.module.entered.is_set()

    asyncio.run(body())


def test_all_replicas_down_raises_shard_unavailable_within_the_deadline():
    async def body():
        addresses = [await dead_address(), await dead_address()]
        async with closing(ShardClient(3, addresses, input_names=["ids_a", "ids_b"])) as shard:
            with pytest.raises(ShardUnavailable) as info:
                await EmbeddingClient([shard]).lookup(toy_inputs(toy_shard()), timeout_s=30)
        assert info.value.shard_index == 3
        assert "UNAVAILABLE" in info.value.last_error and info.value.last_error.split(":")[0] in "".join(addresses)
        assert shard.stats.unavailable == 1 and shard.stats.failovers == 1  # each once: no waiting out the deadline

    asyncio.run(body())


def test_no_replicas_is_shard_unavailable():
    async def body():
        with pytest.raises(ShardUnavailable, match="shard 0 unavailable: no replica addresses"):
            await ShardClient(0, []).lookup({"x": torch.zeros(1)}, timeout_s=1)

    asyncio.run(body())


def test_replica_restarted_at_a_new_address_recovers_after_update_addresses():
    async def body():
        shard = toy_shard()
        old = EmbeddingServer(shard)
        await old.start()
        async with closing(ShardClient(0, [old.address])) as client:
            await client.lookup(toy_inputs(shard), timeout_s=5)
            await old.stop(0)
            with pytest.raises(ShardUnavailable):
                await client.lookup(toy_inputs(shard), timeout_s=1)
            async with serving(shard) as new:
                client.update_addresses([new.address])
                assert client.addresses == (new.address,)
                outputs = await client.lookup(toy_inputs(shard), timeout_s=5)
        assert_same(outputs, shard.module(**toy_inputs(shard)))

    asyncio.run(body())


def test_slow_module_gets_deadline_exceeded_then_shard_unavailable_in_time():
    """The module never answers (held at its gate): the lookup ends at its deadline, not when the module does."""
    async def body():
        shard = gated(toy_shard())
        async with serving(shard) as server, closing(ShardClient(0, [server.address])) as client:
            with pytest.raises(ShardUnavailable) as info:
                await client.lookup(toy_inputs(shard), timeout_s=0.3)
            assert not shard.module.left.is_set()  # given up while the module still held the call
            shard.module.release.set()
        assert "DEADLINE_EXCEEDED" in info.value.last_error

    asyncio.run(body())


def test_refused_input_name_is_a_request_error_not_retried_and_the_server_keeps_serving():
    async def body():
        shard = toy_shard()
        async with (
            serving(shard) as r0,
            serving(shard) as r1,
            closing(ShardClient(0, [r0.address, r1.address])) as client,
        ):
            with pytest.raises(EmbeddingRequestError) as info:
                await client.lookup({"ids_a": torch.tensor([1]), "bogus": torch.tensor([1])}, timeout_s=5)
            assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.shard_index == 0
            assert "unknown input 'bogus'" in str(info.value) and "missing input 'ids_b'" in str(info.value)
            assert client.stats.failovers == 0 and client.stats.request_errors == 1
            await client.lookup(toy_inputs(shard), timeout_s=5)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("inputs", "error"),
    [
        ({"ids_a": torch.tensor([1])}, "embedding shard 0 refused .*missing input 'ids_b'"),
        ({"ids_a": torch.tensor([1]), "ids_b": torch.tensor([1]), "x": torch.tensor([1])}, "unknown input 'x'"),
    ],
)
def test_embedding_client_refuses_missing_or_unknown_inputs_before_sending(inputs, error):
    async def body():
        shard = ShardClient(0, [await dead_address()], input_names=["ids_a", "ids_b"])
        client = EmbeddingClient([shard])
        with pytest.raises(EmbeddingRequestError, match=error):
            await client.lookup(inputs, timeout_s=1)
        assert client.stats.request_errors == 1 and shard.stats.calls == 0

    asyncio.run(body())


def test_oversized_request_is_a_request_error_and_the_server_keeps_serving():
    async def body():
        shard = toy_shard()
        big = {"ids_a": torch.zeros(300_000, dtype=torch.int64), "ids_b": torch.zeros(1, dtype=torch.int64)}
        async with (
            serving(shard, max_message_bytes=1 << 20) as server,
            closing(ShardClient(0, [server.address])) as client,
        ):
            with pytest.raises(EmbeddingRequestError) as info:
                await client.lookup(big, timeout_s=5)
            assert info.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in info.value.details
            await client.lookup(toy_inputs(shard), timeout_s=5)

    asyncio.run(body())


def test_unavailable_shard_fails_the_lookup_at_once_and_cancels_the_others():
    """Shard 0 cannot answer (held at its gate) until the lookup has failed on shard 1 alone."""
    async def body():
        held = gated(toy_shard(0, ("a",)))
        async with serving(held) as server:
            shards = [ShardClient(0, [server.address], input_names=["ids_a"])]
            shards.append(ShardClient(1, [await dead_address()], input_names=["ids_b"]))
            async with closing(EmbeddingClient(shards)) as client:
                with pytest.raises(ShardUnavailable) as info:
                    await client.lookup({"ids_a": torch.tensor([1]), "ids_b": torch.tensor([1])}, timeout_s=60)
                assert not held.module.left.is_set()  # failed while shard 0 still held its call
                held.module.release.set()
        assert info.value.shard_index == 1
        assert client.stats.unavailable == 1

    asyncio.run(body())


def test_shard_unavailable_answers_503_with_retry_after_and_keeps_the_diagnosis_for_logs():
    error = ShardUnavailable(2, "10.0.0.7:50051: UNAVAILABLE: connection refused")
    assert isinstance(error, APIError)
    assert (error.status_code, error.code, error.headers) == (503, "embedding_shard_unavailable", {"Retry-After": "1"})
    assert error.message == "embedding shard 2 is unavailable, retry later"  # no replica address for the client
    assert str(error) == "embedding shard 2 unavailable: 10.0.0.7:50051: UNAVAILABLE: connection refused"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ShardUnavailable and (copy.shard_index, copy.last_error) == (2, error.last_error)


def test_embedding_request_error_answers_500_and_keeps_the_diagnosis_for_logs():
    error = EmbeddingRequestError(1, grpc.StatusCode.INVALID_ARGUMENT, "unknown input 'x'")
    assert isinstance(error, APIError)
    assert (error.status_code, error.code, error.headers) == (500, "internal_error", None)
    assert error.message == "internal error in the embedding lookup"
    assert str(error) == "embedding shard 1 refused the request (INVALID_ARGUMENT): unknown input 'x'"
    assert str(EmbeddingRequestError(None, grpc.StatusCode.INVALID_ARGUMENT, "x")).startswith("embedding request ")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is EmbeddingRequestError and str(copy) == str(error)


def test_a_replica_serving_another_table_version_is_skipped_for_one_serving_the_expected_version():
    async def body():
        stale, current = toy_shard(0, ("a",), version="v2"), toy_shard(0, ("a",), version="v1")
        async with serving(stale) as old, serving(current) as new:
            client = ShardClient(0, [old.address, new.address], expected_version="v1", cooldown_s=60)
            async with closing(client):
                outputs = await client.lookup({"ids_a": torch.tensor([1, 2])}, timeout_s=5)
                await client.lookup({"ids_a": torch.tensor([1, 2])}, timeout_s=5)
        assert_same(outputs, current.module(ids_a=torch.tensor([1, 2])))
        assert stale.module.calls == 1  # tried once, then cooling down: the second lookup went to `current` only
        assert client.stats.failovers == 1 and client.stats.version_mismatches == 0

    asyncio.run(body())


def test_no_replica_serving_the_expected_version_is_a_503_naming_both_versions():
    async def body():
        async with serving(toy_shard(0, ("a",), version="v2-restarted")) as server:
            client = ShardClient(0, [server.address], expected_version="v1-expected")
            async with closing(client):
                with pytest.raises(ShardVersionMismatch) as caught:
                    await client.lookup({"ids_a": torch.tensor([1])}, timeout_s=5)
        return caught.value, client.stats.version_mismatches

    error, mismatches = asyncio.run(body())
    assert mismatches == 1
    assert error.status_code == 503 and error.code == "embedding_version_mismatch" and "Retry-After" in error.headers
    assert "v2-restarted" in str(error) and "v1-expected" in str(error)
    assert pickle.loads(pickle.dumps(error)).served == "v2-restarted"  # crosses Ray intact


def test_a_new_version_from_a_restarted_shard_is_reported_once():
    async def body():
        changes = []
        async with serving(toy_shard(0, ("a",), version="v1")) as first:
            client = ShardClient(0, [first.address], on_new_version=lambda index, v: changes.append((index, v)))
            await client.lookup({"ids_a": torch.tensor([1])}, timeout_s=5)
            await client.lookup({"ids_a": torch.tensor([1])}, timeout_s=5)
        assert changes == []
        async with serving(toy_shard(0, ("a",), version="v2")) as restarted:
            client.update_addresses([restarted.address])
            await client.lookup({"ids_a": torch.tensor([1])}, timeout_s=5)
            await client.lookup({"ids_a": torch.tensor([1])}, timeout_s=5)
            await client.close()
        return changes

    assert asyncio.run(body()) == [(0, "v2")]


def test_a_shard_whose_inputs_are_all_empty_is_not_called():
    async def body():
        first, second = toy_shard(0, ("a",)), toy_shard(1, ("b",))
        async with serving(first) as s0, serving(second) as s1:
            shards = [ShardClient(0, [s0.address], input_names=["ids_a"]),
                      ShardClient(1, [s1.address], input_names=["ids_b"])]
            async with closing(EmbeddingClient(shards)) as client:
                outputs = await client.lookup({"ids_a": torch.tensor([1]), "ids_b": torch.empty(0, dtype=torch.int64)},
                                              timeout_s=5)
        assert outputs.keys() == {"pooled_a"}
        assert (first.module.calls, second.module.calls) == (1, 0)

    asyncio.run(body())
