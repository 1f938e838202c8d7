"""Set-associative LRU / LFU embedding-row caches of the dense replicas."""

import threading

import numpy as np
import pytest
import torch

from disagg.embedding_cache import EmbeddingCache, TableCache, set_index

DIM = 4


def row_of(ids: torch.Tensor, table: int = 0, dim: int = DIM) -> torch.Tensor:
    """A row that identifies its (table, id)."""
    return ids.to(torch.float32).unsqueeze(1) * 10 + table * 100_000 + torch.arange(dim, dtype=torch.float32)


def ids_in_set(cache: TableCache, target: int, count: int) -> torch.Tensor:
    candidates = torch.arange(100_000)
    found = candidates[set_index(candidates, cache.sets) == target][:count]
    assert found.numel() == count
    return found


def cached(cache: TableCache, ids: list[int] | torch.Tensor) -> list[bool]:
    hit, _ = cache.lookup(torch.as_tensor(ids, dtype=torch.int64))
    return hit.tolist()


def rows_of(tables: dict[str, torch.Tensor], dim: int = DIM) -> torch.Tensor:
    """The rows of a batch laid out as ``EmbeddingCache`` takes it; table ``i`` of ``tables`` is ``row_of``'s
    ``table=i``."""
    return torch.cat([row_of(ids, position, dim) for position, ids in enumerate(tables.values())])


def batch(tables: dict[str, torch.Tensor]) -> tuple[list[str], list[int], torch.Tensor]:
    """``(tables, counts, ids)`` of an ``EmbeddingCache`` lookup of ``tables`` (name -> its ids)."""
    return list(tables), [ids.numel() for ids in tables.values()], torch.cat(list(tables.values()))


def run_in_threads(worker, seeds) -> None:
    """``worker(seed)`` for each seed, each in its own thread, all at once; returns when all are done."""
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def assert_consistent(cache: TableCache) -> None:
    """Every filled slot holds the row of its own tag, and no id is in two slots."""
    filled = cache.tags >= 0
    torch.testing.assert_close(cache.rows[filled], row_of(cache.tags[filled]), rtol=0, atol=0)
    assert cache.tags[filled].unique().numel() == int(filled.sum())


def test_set_index_is_nonnegative_and_spreads_consecutive_ids() -> None:
    ids = torch.tensor([0, 1, 2**40, 2**62, 2**63 - 1, *range(3, 1000)])
    sets = set_index(ids, 7)
    assert int(sets.min()) >= 0 and int(sets.max()) < 7
    assert torch.bincount(set_index(torch.arange(8000), 8), minlength=8).min() > 800


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_hits_return_the_inserted_rows_and_never_inserted_ids_miss(policy: str) -> None:
    cache = TableCache(DIM, 64, policy=policy, ways=4)
    inserted = torch.tensor([5, 17, 3, 1000, 42])
    cache.insert(inserted, row_of(inserted))
    hit, rows = cache.lookup(torch.tensor([42, 7, 5, 999, 1000, 3, 17]))
    assert hit.tolist() == [True, False, True, False, True, True, True]
    torch.testing.assert_close(rows, row_of(torch.tensor([42, 5, 1000, 3, 17])), rtol=0, atol=0)
    assert (cache.hits, cache.lookups) == (5, 7)


def test_lookup_rows_are_a_copy_that_survives_eviction() -> None:
    cache = TableCache(DIM, 1, policy="lru", ways=1)
    cache.insert(torch.tensor([1]), row_of(torch.tensor([1])))
    _, rows = cache.lookup(torch.tensor([1]))
    cache.clear()
    cache.insert(torch.tensor([2]), row_of(torch.tensor([2])))
    torch.testing.assert_close(rows, row_of(torch.tensor([1])), rtol=0, atol=0)


def test_inserting_a_cached_id_keeps_its_row() -> None:
    cache = TableCache(DIM, 8, policy="lru", ways=8)
    cache.insert(torch.tensor([3]), row_of(torch.tensor([3])))
    cache.insert(torch.tensor([3, 4]), torch.zeros(2, DIM))
    hit, rows = cache.lookup(torch.tensor([3, 4]))
    assert hit.tolist() == [True, True]
    torch.testing.assert_close(rows[0], row_of(torch.tensor([3]))[0], rtol=0, atol=0)
    assert int((cache.tags == 3).sum()) == 1


def test_capacity_is_respected_and_rounded_up_to_whole_sets() -> None:
    cache = TableCache(DIM, 30, policy="lru", ways=8)
    assert (cache.sets, cache.capacity_rows) == (4, 32)
    assert cache.nbytes == 32 * (DIM * 4 + 16)
    ids = torch.arange(500)
    cache.insert(ids, row_of(ids))
    hit, rows = cache.lookup(ids)
    assert int(hit.sum()) == 32
    torch.testing.assert_close(rows, row_of(ids[hit]), rtol=0, atol=0)
    assert_consistent(cache)


def test_lru_evicts_the_least_recently_used_way_of_the_set() -> None:
    cache = TableCache(DIM, 32, policy="lru", ways=4)
    a, b, c, d, e, f = ids_in_set(cache, 3, 6).tolist()
    other = ids_in_set(cache, 5, 1)
    cache.insert(torch.tensor([a, b, c, d]), row_of(torch.tensor([a, b, c, d])))
    cache.insert(other, row_of(other))
    for used in ([c], [a, b], [d]):  # last used at ticks: c 1, a 2, b 2, d 3
        cached(cache, used)
    cache.insert(torch.tensor([e]), row_of(torch.tensor([e])))  # evicts c; e gets tick 3
    cache.insert(torch.tensor([f]), row_of(torch.tensor([f])))  # evicts a (tick 2, lower way than b)
    assert cached(cache, [a, b, c, d, e, f]) == [False, True, False, True, True, True]
    assert cached(cache, other) == [True]
    assert_consistent(cache)


def test_lfu_evicts_the_least_frequently_used_way_of_the_set() -> None:
    cache = TableCache(DIM, 32, policy="lfu", ways=4)
    a, b, c, d, e, f = ids_in_set(cache, 6, 6).tolist()
    cache.insert(torch.tensor([a, b, c, d]), row_of(torch.tensor([a, b, c, d])))
    for used in ([a, b, d], [a, b, d], [c, a], [a]):  # counts: a 5, b 3, c 2, d 3
        cached(cache, used)
    cache.insert(torch.tensor([e]), row_of(torch.tensor([e])))
    assert cached(cache, [a, b, c, d, e]) == [True, True, False, True, True]  # e: count 2 now, others +1
    cache.insert(torch.tensor([f]), row_of(torch.tensor([f])))
    assert cached(cache, [a, b, d, e, f]) == [True, True, True, False, True]


def test_new_ids_of_one_set_take_distinct_ways_lowest_priority_first() -> None:
    cache = TableCache(DIM, 16, policy="lru", ways=4)
    in_set = ids_in_set(cache, 1, 8)
    old, new = in_set[:2], in_set[2:]
    elsewhere = ids_in_set(cache, 2, 3)
    cache.insert(old, row_of(old))
    cached(cache, old[:1])  # old[1] is now the least recently used of the set, after its two empty ways
    batch = torch.cat([new[:3], elsewhere, new[3:]])
    cache.insert(batch, row_of(batch))
    assert_consistent(cache)
    assert cached(cache, new) == [True, True, True, True, False, False]
    assert cached(cache, old) == [False, False]
    assert cached(cache, elsewhere) == [True, True, True]


def test_zipf_stream_hits_more_with_a_larger_budget() -> None:
    rows, dim = 20_000, 8
    generator = np.random.default_rng(0)
    batches = [torch.from_numpy((generator.zipf(1.2, size=512) - 1) % rows) for _ in range(60)]

    def hit_rate(max_bytes: int) -> float:
        cache = EmbeddingCache({"t": (rows, dim)}, max_bytes=max_bytes)
        for stream in batches:
            ids = stream.unique()
            hit, hit_rows = cache.lookup(["t"], [ids.numel()], ids)
            torch.testing.assert_close(hit_rows, ids[hit].to(torch.float32).unsqueeze(1).expand(-1, dim))
            misses = ids[~hit]
            cache.insert(["t"], [misses.numel()], misses, misses.to(torch.float32).unsqueeze(1).expand(-1, dim))
        hits, lookups = cache.stats()["t"]
        return hits / lookups

    small, large = hit_rate(100 * (dim * 4 + 16)), hit_rate(4000 * (dim * 4 + 16))
    assert 0 < small < large


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_concurrent_lookups_and_inserts_only_return_rows_inserted_for_the_id(policy: str) -> None:
    cache = TableCache(DIM, 96, policy=policy, ways=4)
    errors: list[str] = []

    def worker(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(200):
            ids = torch.randint(0, 400, (64,), generator=generator).unique()
            hit, rows = cache.lookup(ids)
            if not torch.equal(rows, row_of(ids[hit])):
                errors.append(f"wrong rows for ids {ids[hit].tolist()}")
            misses = ids[~hit]
            cache.insert(misses, row_of(misses))

    run_in_threads(worker, seeds=range(4))
    assert errors == []
    assert cache.hits > 0
    assert_consistent(cache)


def test_clear_empties_the_cache_and_keeps_counters() -> None:
    cache = EmbeddingCache({"a": (100, DIM), "b": (100, DIM)}, max_bytes=10_000)
    ids = torch.arange(10)
    both = {"a": ids, "b": ids}
    cache.insert(*batch(both), rows_of(both))
    cache.clear("a")
    hit, rows = cache.lookup(*batch(both))
    assert hit.tolist() == [False] * 10 + [True] * 10
    torch.testing.assert_close(rows, row_of(ids, 1), rtol=0, atol=0)
    cache.clear()
    hit, _ = cache.lookup(["b"], [10], ids)
    assert not hit.any()
    assert cache.stats() == {"a": (0, 10), "b": (10, 20)}


def test_budget_is_split_in_proportion_to_table_bytes_and_capped_by_table_rows() -> None:
    slot = 16 * 4 + 16
    tables = {"big": (10_000, 16), "small": (1_000, 16), "tiny": (5, 16)}
    max_bytes = 1_100 * slot
    cache = EmbeddingCache(tables, max_bytes=max_bytes, ways=8)
    big_share = max_bytes * 10_000 // 11_005 // slot  # 999 rows
    small_share = max_bytes * 1_000 // 11_005 // slot  # 99 rows
    # tiny's share is under one slot: not cached at all
    assert cache.capacity_rows == {"big": -(-big_share // 8) * 8, "small": -(-small_share // 8) * 8, "tiny": 0}
    assert cache.nbytes == sum(cache.capacity_rows.values()) * slot
    assert cache.nbytes - max_bytes < 3 * 8 * slot
    everything = EmbeddingCache({"a": (100, 16), "b": (30, 8)}, max_bytes=10**9, ways=4)
    assert everything.capacity_rows == {"a": 100, "b": 32}


def test_zero_budget_never_hits() -> None:
    cache = EmbeddingCache({"t": (1000, DIM)}, max_bytes=0)
    ids = torch.arange(50)
    cache.insert(["t"], [50], ids, row_of(ids))
    hit, rows = cache.lookup(["t"], [50], ids)
    assert not hit.any() and rows.shape == (0, DIM)
    assert cache.nbytes == 0 and cache.capacity_rows == {"t": 0}
    assert cache.stats() == {"t": (0, 50)}


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=-1), "max_bytes"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100, ways=0), "ways"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100, policy="fifo"), "policy"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).lookup(["u"], [1], torch.tensor([1])), "'u'"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).lookup(["t", "u"], [1, 1], torch.tensor([1, 2])), "'u'"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).insert(["u"], [1], torch.tensor([1]), torch.zeros(1, 4)),
         "'u'"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).clear("u"), "'u'"),
        (lambda: EmbeddingCache({"t": (10, 0)}, max_bytes=100), "tables['t']"),
        (lambda: TableCache(4, -1, policy="lru"), "capacity_rows"),
        (lambda: TableCache(4, 8, policy="lru", ways=0), "ways"),
        (lambda: TableCache(4, 8, policy="mru"), "policy"),
        (lambda: TableCache(4, 8, policy="lru").lookup(torch.tensor([1, -1])), "ids"),
        (lambda: TableCache(4, 8, policy="lru").lookup(torch.tensor([[1]])), "ids"),
        (lambda: TableCache(4, 8, policy="lru").insert(torch.tensor([1]), torch.zeros(1, 3)), "rows"),
    ],
)
def test_invalid_arguments_raise_value_errors_naming_them(make, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).lookup(["t"], [2], torch.tensor([1])), "counts"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).lookup(["t"], [1, 0], torch.tensor([1])), "counts"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).insert(["t"], [0], torch.tensor([1]), torch.zeros(1, 4)),
         "counts"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).lookup([], [], torch.tensor([])), "tables"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=100).lookup(["t"], [2], torch.tensor([1, -3])), "ids.*-3"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=0).insert(["t"], [1], torch.tensor([-1]), torch.zeros(1, 4)),
         "ids.*-1"),
    ],
)
def test_malformed_embedding_cache_batches_raise_value_errors_naming_them(make, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize(
    ("make", "field"),
    [
        # A negative count whose sum still matches the ids reaches torch.repeat_interleave (RuntimeError).
        (lambda: EmbeddingCache({"t": (10, 4), "u": (10, 4)}, max_bytes=1000).lookup(["t", "u"], [3, -1],
                                                                                      torch.tensor([1, 2])), "counts"),
        # Floating ids are cast to int64 (1.5 -> 1) before TableCache's integer check could see them.
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=1000).lookup(["t"], [1], torch.tensor([1.5])), "ids"),
        # 2-D ids reach index_select (IndexError).
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=1000).lookup(["t"], [2], torch.tensor([[1, 2]])), "ids"),
        # rows are index_select-ed by the cacheable positions before TableCache checks their shape: extra rows are
        # silently dropped, missing ones raise IndexError.
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=1000).insert(["t"], [2], torch.tensor([1, 2]),
                                                                       torch.zeros(3, 4)), "rows"),
        (lambda: EmbeddingCache({"t": (10, 4)}, max_bytes=1000).insert(["t"], [2], torch.tensor([1, 2]),
                                                                       torch.zeros(1, 4)), "rows"),
    ],
)
def test_embedding_cache_checks_ids_counts_and_rows_itself(make, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def test_equal_ids_of_two_tables_never_see_each_others_rows() -> None:
    cache = EmbeddingCache({"a": (4, DIM), "b": (4, DIM)}, max_bytes=10**6, ways=4)  # one full set each
    assert cache.capacity_rows == {"a": 4, "b": 4}
    ids = torch.arange(4)
    both = {"a": ids, "b": ids}
    cache.insert(*batch(both), rows_of(both))
    hit, rows = cache.lookup(*batch(both))
    assert hit.all()
    torch.testing.assert_close(rows, rows_of(both), rtol=0, atol=0)
    only_a = EmbeddingCache({"a": (100, DIM), "b": (100, DIM)}, max_bytes=10**6)
    only_a.insert(["a"], [3], torch.tensor([5, 6, 7]), row_of(torch.tensor([5, 6, 7])))
    hit, _ = only_a.lookup(["b", "a"], [3, 3], torch.tensor([5, 6, 7, 5, 6, 7]))
    assert hit.tolist() == [False] * 3 + [True] * 3


def test_clearing_one_table_keeps_the_rows_of_the_others_in_its_group() -> None:
    cache = EmbeddingCache({"a": (100, DIM), "b": (100, DIM), "c": (100, DIM)}, max_bytes=10**6, ways=4)
    ids = torch.arange(0, 60, 2)
    tables = {"a": ids, "b": ids, "c": ids}

    def hits() -> list[int]:
        hit, rows = cache.lookup(*batch(tables))
        torch.testing.assert_close(rows, rows_of(tables)[hit], rtol=0, atol=0)
        return [int(part.sum()) for part in hit.split(ids.numel())]

    cache.insert(*batch(tables), rows_of(tables))
    assert hits() == [30, 30, 30]
    cache.clear("b")
    assert hits() == [30, 0, 30]
    cache.clear("a")
    assert hits() == [0, 0, 30]
    cache.insert(*batch(tables), rows_of(tables))
    cache.clear("c")
    assert hits() == [30, 30, 0]


@pytest.mark.parametrize("order", [("big", "tiny"), ("tiny", "big")])
def test_a_table_given_no_sets_never_hits_while_the_others_of_its_group_do(order: tuple[str, str]) -> None:
    sizes = {"big": (10_000, DIM), "tiny": (5, DIM)}
    cache = EmbeddingCache({name: sizes[name] for name in order}, max_bytes=100 * (DIM * 4 + 16), ways=4)
    assert cache.capacity_rows == {"big": 100, "tiny": 0}
    ids = torch.arange(5)
    tables = {name: ids for name in order}
    cache.insert(*batch(tables), rows_of(tables))
    hit, rows = cache.lookup(*batch(tables))
    big = order.index("big")
    assert hit.tolist() == [position == big for position in range(2) for _ in range(5)]
    torch.testing.assert_close(rows, row_of(ids, big), rtol=0, atol=0)
    assert cache.stats() == {"big": (5, 5), "tiny": (0, 5)}


def test_tables_of_different_widths_live_in_separate_caches_and_cannot_share_a_lookup() -> None:
    cache = EmbeddingCache({"a": (50, 4), "w": (50, 8), "c": (50, 4)}, max_bytes=10**6, ways=8)
    assert cache.capacity_rows == {"a": 56, "w": 56, "c": 56}
    assert cache.nbytes == 112 * (4 * 4 + 16) + 56 * (8 * 4 + 16)
    ids = torch.arange(10)
    narrow = {"a": ids, "c": ids}
    cache.insert(*batch(narrow), rows_of(narrow, 4))
    cache.insert(["w"], [10], ids, row_of(ids, 7, 8))
    hit, rows = cache.lookup(*batch(narrow))
    assert hit.all()
    torch.testing.assert_close(rows, rows_of(narrow, 4), rtol=0, atol=0)
    hit, rows = cache.lookup(["w"], [10], ids)
    assert hit.all()
    torch.testing.assert_close(rows, row_of(ids, 7, 8), rtol=0, atol=0)
    with pytest.raises(ValueError, match="same row width"):
        cache.lookup(["a", "w"], [1, 1], torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="same row width"):
        cache.insert(["w", "c"], [1, 1], torch.tensor([1, 1]), torch.zeros(2, 8))


def test_stats_count_each_table_of_a_combined_lookup_separately() -> None:
    cache = EmbeddingCache({"a": (100, DIM), "b": (100, DIM), "idle": (100, DIM)}, max_bytes=10**6)
    cache.insert(["a", "b"], [2, 1], torch.tensor([1, 2, 3]), rows_of({"a": torch.tensor([1, 2]),
                                                                        "b": torch.tensor([3])}))
    tables = {"a": torch.tensor([1, 2, 3]), "b": torch.tensor([1, 3, 4, 5])}
    hit, rows = cache.lookup(*batch(tables))
    assert hit.tolist() == [True, True, False, False, True, False, False]
    torch.testing.assert_close(rows, rows_of(tables)[hit], rtol=0, atol=0)
    assert cache.stats() == {"a": (2, 3), "b": (1, 4), "idle": (0, 0)}
    cache.lookup(["b"], [1], torch.tensor([3]))
    assert cache.stats() == {"a": (2, 3), "b": (2, 5), "idle": (0, 0)}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_concurrent_embedding_cache_batches_only_return_rows_inserted_for_the_table_and_id(policy: str) -> None:
    cache = EmbeddingCache({"a": (400, DIM), "b": (400, DIM)}, max_bytes=96 * (DIM * 4 + 16), policy=policy, ways=4)
    assert cache.capacity_rows == {"a": 48, "b": 48}
    errors: list[str] = []

    def worker(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(200):
            tables = {name: torch.randint(0, 400, (32,), generator=generator).unique() for name in ("a", "b")}
            hit, rows = cache.lookup(*batch(tables))
            if not torch.equal(rows, rows_of(tables)[hit]):
                errors.append(f"wrong rows for {tables} at {hit.nonzero().squeeze(1).tolist()}")
            misses = {name: ids[~part] for (name, ids), part in zip(tables.items(), hit.split(
                [ids.numel() for ids in tables.values()]), strict=True)}
            cache.insert(*batch(misses), rows_of(misses))

    run_in_threads(worker, seeds=range(4))
    assert errors == []
    assert all(hits > 0 for hits, _ in cache.stats().values())
    everything = {"a": torch.arange(400), "b": torch.arange(400)}
    hit, rows = cache.lookup(*batch(everything))
    assert [int(part.sum()) for part in hit.split(400)] == [48, 48]  # every slot is filled, each by its own row
    torch.testing.assert_close(rows, rows_of(everything)[hit], rtol=0, atol=0)


def test_table_cache_places_ids_in_the_sets_it_is_given() -> None:
    cache = TableCache(DIM, 32, policy="lru", ways=4)  # 8 sets
    ids = torch.tensor([10, 11, 12, 13])
    sets = torch.tensor([2, 2, 7, 2])
    assert not torch.equal(set_index(ids, cache.sets), sets)
    cache.insert(ids, row_of(ids), sets)
    expected = torch.full((8, 4), -1)
    expected[2, :3] = torch.tensor([10, 11, 13])
    expected[7, 0] = 12
    assert torch.equal(cache.tags.view(8, 4), expected)
    assert_consistent(cache)
    hit, rows = cache.lookup(ids, sets)
    assert hit.all()
    torch.testing.assert_close(rows, row_of(ids), rtol=0, atol=0)
    hit, _ = cache.lookup(torch.tensor([10]), torch.tensor([3]))
    assert not hit.any()


def test_table_cache_clears_exactly_the_given_range_of_sets() -> None:
    cache = TableCache(DIM, 32, policy="lfu", ways=4)  # 8 sets
    ids = torch.arange(100, 116)
    sets = torch.arange(16) % 8  # two ids per set
    cache.insert(ids, row_of(ids), sets)
    cache.clear(2, 5)
    filled = (cache.tags.view(8, 4) >= 0).sum(dim=1)
    assert filled.tolist() == [2, 2, 0, 0, 0, 2, 2, 2]
    assert (cache.priority.view(8, 4)[2:5] == -1).all()
    hit, _ = cache.lookup(ids, sets)
    assert hit.tolist() == [not 2 <= set_ < 5 for set_ in sets.tolist()]
    cache.clear(6)
    assert ((cache.tags.view(8, 4) >= 0).sum(dim=1)).tolist() == [2, 2, 0, 0, 0, 2, 0, 0]
