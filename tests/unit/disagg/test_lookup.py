"""RemoteEmbeddings over in-process shards: equal to the monolithic embedding part with dedup, cache, row-wise
slices and chunked calls; reduced wire precision within its rounding; over gRPC, a shard restarted with other
tables is refused (503) and leaves nothing of them in the cache."""

import asyncio

import pytest
import torch

from disagg.embedding_cache import EmbeddingCache
from disagg.lookup import LocalRows, RemoteEmbeddings
from disagg.model import DLRM
from disagg.model_source import PresetSource
from disagg.partition import build_dense_part, embedding_lookups, partition_embeddings
from disagg.rpc.client import EmbeddingClient, ShardClient, ShardVersionMismatch
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from disagg.tables import TableLayout, build_embedding_shard, shard_version, weights_source
from tests.helpers.embedding_shards import serving

SPEC = preset_spec("tiny")
SEED = 3
#: Splits every tiny table (1000 rows x 16 float32 = 64,000 bytes) above 40,000 bytes by id range.
ROW_WISE = 40_000


class CountingRows(LocalRows):
    """LocalRows that records, per batch, the non-empty ids each slice was asked for (by slice name), and each
    packed call's alone."""

    def __init__(self, shards) -> None:
        super().__init__(shards)
        self.shards = shards
        self.calls: list[dict[str, torch.Tensor]] = []
        self.packed_calls: list[dict[str, torch.Tensor]] = []

    def start_packed(self, calls, *, timeout_s, output_dtype=""):
        for call in calls:
            names = self.shards[call.shard].input_names
            self.packed_calls.append({name: ids for name, ids in zip(names, call.ids.split(call.counts), strict=True)
                                      if ids.numel()})
        self.calls.append({name: ids for call in self.packed_calls[-len(calls):] for name, ids in call.items()})
        return super().start_packed(calls, timeout_s=timeout_s, output_dtype=output_dtype)


def _embeddings(layout: TableLayout, *, cache_bytes: int = 0, wire: str = "float32",
                max_message_bytes: int = 64 * 2**20) -> tuple[RemoteEmbeddings, CountingRows]:
    lookups = embedding_lookups(build_dense_part(PresetSource("tiny", SEED)))
    shards = [build_embedding_shard(PresetSource("tiny", SEED), index, layout) for index in range(layout.num_shards)]
    rows = CountingRows(shards)
    cache = EmbeddingCache(lookups.tables, max_bytes=cache_bytes) if cache_bytes else None
    embeddings = RemoteEmbeddings(lookups, layout.plan(lookups.tables), rows, cache=cache, wire_dtype=wire,
                                  max_message_bytes=max_message_bytes)
    return embeddings, rows


def _reference(sparse: torch.Tensor) -> dict[str, torch.Tensor]:
    partition = partition_embeddings(DLRM(SPEC, seed=SEED))
    with torch.inference_mode():
        return partition.embedding_part(sparse=sparse)


def _run(embeddings: RemoteEmbeddings, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
    return asyncio.run(embeddings({"sparse": sparse}, timeout_s=10.0))


def _assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol)


@pytest.mark.parametrize("layout", [TableLayout(2), TableLayout(3, row_wise_min_bytes=ROW_WISE)],
                         ids=["table-wise", "row-wise"])
def test_fp32_rows_equal_the_monolithic_embedding_part(layout):
    _, sparse = SyntheticRequests(SPEC, seed=1, max_hotness=4).batch(64)
    embeddings, _ = _embeddings(layout)
    _assert_close(_run(embeddings, sparse), _reference(sparse), atol=1e-6)


def test_each_unique_id_is_fetched_once_as_a_local_int32_id_of_its_slice():
    layout = TableLayout(2, row_wise_min_bytes=ROW_WISE)
    embeddings, rows = _embeddings(layout)
    sparse = torch.zeros(2, SPEC.num_tables, 4, dtype=torch.int64)
    sparse[:, 0] = torch.tensor([[5, 5, 999, -1], [999, 7, -1, -1]])  # table 0 has 1000 rows
    _run(embeddings, sparse)
    (call,) = rows.calls
    table = next(piece for slices in layout.plan(embeddings.lookups.tables) for piece in slices
                 if piece.table == "embeddings.0" and piece.row_start > 0)
    assert call[table.name].dtype == torch.int32
    assert call[table.name].tolist() == [999 - table.row_start]  # 999 once, as a local id of the upper slice
    lower = next(piece for slices in layout.plan(embeddings.lookups.tables) for piece in slices
                 if piece.table == "embeddings.0" and piece.row_start == 0)
    assert call[lower.name].tolist() == [0, 5, 7]  # padding (-1) is clamped to 0 by the model, then deduplicated


def test_cached_rows_skip_the_rpc_and_give_the_same_answer():
    embeddings, rows = _embeddings(TableLayout(2), cache_bytes=SPEC.total_rows * SPEC.embedding_dim * 8)
    _, sparse = SyntheticRequests(SPEC, seed=2).batch(32)
    first = _run(embeddings, sparse)
    second = _run(embeddings, sparse)
    assert len(rows.calls) == 1  # the second batch found every row in the cache
    _assert_close(second, first, atol=0)
    _assert_close(second, _reference(sparse), atol=1e-6)


def test_dropping_a_shards_cache_refetches_only_its_tables():
    layout = TableLayout(2)
    embeddings, rows = _embeddings(layout, cache_bytes=SPEC.total_rows * SPEC.embedding_dim * 8)
    _, sparse = SyntheticRequests(SPEC, seed=2).batch(32)
    _run(embeddings, sparse)
    embeddings.drop_cached(1)
    _run(embeddings, sparse)
    shard_one = {piece.name for piece in layout.plan(embeddings.lookups.tables)[1]}
    assert set(rows.calls[1]) == shard_one


def test_replies_over_half_the_message_limit_are_split_into_chunks_with_the_same_answer():
    _, sparse = SyntheticRequests(SPEC, seed=4, max_hotness=8).batch(256)
    layout = TableLayout(2)
    embeddings, rows = _embeddings(layout, max_message_bytes=64 * 1024)
    _assert_close(_run(embeddings, sparse), _reference(sparse), atol=1e-6)
    assert len(rows.calls) == 1 and len(rows.packed_calls) > len(layout.plan(embeddings.lookups.tables))
    row_bytes = SPEC.embedding_dim * 4
    for call in rows.packed_calls:  # each call's reply: half the limit, and a row of slack for the uneven split
        assert sum(ids.numel() for ids in call.values()) * row_bytes <= 32 * 1024 + row_bytes


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_half_precision_rows_stay_within_their_rounding(wire):
    _, sparse = SyntheticRequests(SPEC, seed=5).batch(64)
    embeddings, _ = _embeddings(TableLayout(2), wire=wire)
    got, expected = _run(embeddings, sparse), _reference(sparse)
    relative = {"float16": 2**-11, "bfloat16": 2**-8}[wire]
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=relative, atol=1e-7)
        assert not torch.equal(got[name], expected[name]) or expected[name].abs().max() == 0


def test_an_unknown_wire_dtype_is_refused():
    with pytest.raises(ValueError, match="wire_dtype"):
        _embeddings(TableLayout(2), wire="int8")


def test_a_shard_restarted_with_other_tables_gives_503_drops_its_cached_rows_and_recovers():
    layout = TableLayout(2)
    lookups = embedding_lookups(build_dense_part(PresetSource("tiny", SEED)))
    plan = layout.plan(lookups.tables)
    expected = [shard_version(weights_source(SEED, None), slices, layout) for slices in plan]
    shards = [build_embedding_shard(PresetSource("tiny", SEED), index, layout) for index in range(2)]
    other_model = build_embedding_shard(PresetSource("tiny", SEED + 1), 1, layout)
    _, sparse = SyntheticRequests(SPEC, seed=6).batch(64)
    _, fresh = SyntheticRequests(SPEC, seed=7).batch(64)
    shard_one = {piece.table for piece in plan[1]}

    async def body():
        async with serving(shards[0]) as s0, serving(shards[1]) as s1:
            client = EmbeddingClient([ShardClient(index, [server.address], input_names=[p.name for p in plan[index]],
                                                  expected_version=expected[index])
                                      for index, server in enumerate((s0, s1))])
            cache = EmbeddingCache(lookups.tables, max_bytes=SPEC.total_rows * SPEC.embedding_dim * 8)
            embeddings = RemoteEmbeddings(lookups, plan, client, cache=cache)
            embeddings.drop_cached_on_new_versions(client)
            first = await embeddings({"sparse": sparse}, timeout_s=5)
            async with serving(other_model) as wrong:
                client.shards[1].update_addresses([wrong.address])
                with pytest.raises(ShardVersionMismatch):
                    await embeddings({"sparse": fresh}, timeout_s=5)
                stale = {table for table, (rows, _) in lookups.tables.items()
                         if cache.lookup([table], [rows], torch.arange(rows))[0].any()}
            client.shards[1].update_addresses([s1.address])
            recovered = await embeddings({"sparse": fresh}, timeout_s=5)
            await client.close()
        return first, stale, recovered

    first, cached_after_restart, recovered = asyncio.run(body())
    _assert_close(first, _reference(sparse), atol=1e-6)
    assert cached_after_restart and not cached_after_restart & shard_one  # shard 1's tables dropped, shard 0's kept
    _assert_close(recovered, _reference(fresh), atol=1e-6)  # nothing of the other model was left in the cache


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_dedup_cache_and_row_wise_slices_together_equal_the_monolithic_part_batch_after_batch(policy):
    layout = TableLayout(3, row_wise_min_bytes=ROW_WISE)
    lookups = embedding_lookups(build_dense_part(PresetSource("tiny", SEED)))
    shards = [build_embedding_shard(PresetSource("tiny", SEED), index, layout) for index in range(3)]
    cache = EmbeddingCache(lookups.tables, max_bytes=SPEC.total_rows * SPEC.embedding_dim, policy=policy)
    embeddings = RemoteEmbeddings(lookups, layout.plan(lookups.tables), LocalRows(shards), cache=cache)
    generator = SyntheticRequests(SPEC, seed=8, max_hotness=3)
    for _ in range(4):  # the cache fills, evicts and serves hits across the batches
        _, sparse = generator.batch(128)
        _assert_close(_run(embeddings, sparse), _reference(sparse), atol=1e-6)
    hits, lookups_made = map(sum, zip(*cache.stats().values(), strict=True))
    assert 0 < hits < lookups_made
