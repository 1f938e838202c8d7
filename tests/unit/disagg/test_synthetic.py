"""Synthetic DLRM requests: shapes, padding layout, determinism, power-law ids (no Ray)."""

import numpy as np
import pytest
import torch

from disagg.spec import DLRMSpec, preset_spec
from disagg.synthetic import SyntheticRequests

SPEC = DLRMSpec(num_dense=5, table_sizes=(3, 1000, 100_000), embedding_dim=4, bottom_mlp=(4,), top_mlp=(1,))


@pytest.mark.parametrize("max_hotness", [1, 6])
def test_batch_shapes_dtypes_and_ranges(max_hotness: int) -> None:
    dense, sparse = SyntheticRequests(SPEC, seed=1, max_hotness=max_hotness).batch(2000)
    assert dense.shape == (2000, 5) and dense.dtype == torch.float32
    assert torch.isfinite(dense).all() and (dense >= 0).all()
    assert dense.std(dim=0).min() > 0.1  # features vary
    assert sparse.shape == (2000, 3, max_hotness) and sparse.dtype == torch.int64
    for table, rows in enumerate(SPEC.table_sizes):
        ids = sparse[:, table]
        assert ids.min() >= -1 and ids.max() < rows
        assert ((ids >= 0).sum(dim=1) >= 1).all()  # no empty bag


def test_bags_are_ids_then_padding_with_every_length_used() -> None:
    sparse = SyntheticRequests(SPEC, seed=2, max_hotness=4).batch(3000)[1]
    present = sparse >= 0
    lengths = present.sum(dim=2)
    # Ids fill the first ``length`` slots; the rest are -1.
    assert torch.equal(present, torch.arange(4) < lengths.unsqueeze(-1))
    assert set(lengths.unique().tolist()) == {1, 2, 3, 4}
    assert not (lengths == lengths[:, :1]).all()  # lengths vary per bag, not only per row


def test_one_hot_has_no_padding() -> None:
    sparse = SyntheticRequests(SPEC, seed=0).batch(500)[1]
    assert (sparse >= 0).all()


def test_same_seed_same_batches_different_seed_different_batches() -> None:
    first, again, other = (SyntheticRequests(SPEC, seed=s, max_hotness=3) for s in (7, 7, 8))
    for _ in range(2):
        (dense, sparse), (dense_again, sparse_again) = first.batch(64), again.batch(64)
        assert torch.equal(dense, dense_again) and torch.equal(sparse, sparse_again)
    dense_other, sparse_other = other.batch(64)
    assert not torch.equal(first.batch(64)[1], sparse_other)
    assert not torch.equal(SyntheticRequests(SPEC, seed=7).batch(64)[0], dense_other)


def test_streams_share_the_distribution_and_differ_in_their_rows() -> None:
    first, second = (SyntheticRequests(SPEC, seed=4, stream=stream) for stream in (0, 1))
    assert first._offsets == second._offsets and np.array_equal(first._count_means, second._count_means)
    a, b = first.batch(200), second.batch(200)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    again = SyntheticRequests(SPEC, seed=4, stream=1).batch(200)
    assert torch.equal(again[0], b[0]) and torch.equal(again[1], b[1])


def test_ids_follow_a_power_law_with_hot_ids_spread_over_the_table() -> None:
    ids = SyntheticRequests(SPEC, seed=3, zipf_alpha=1.05).batch(200_000)[1][:, 2, 0].numpy()
    counts = np.sort(np.bincount(ids, minlength=100_000))[::-1]
    top_share = counts[:1000].sum() / ids.size  # the hottest 1% of ids
    assert top_share > 0.5
    hottest = np.argsort(np.bincount(ids, minlength=100_000))[::-1][:10]
    assert hottest.max() - hottest.min() > 1000  # spread by a seeded permutation, not ids 0..9


def test_larger_alpha_is_more_skewed() -> None:
    def top_share(alpha: float) -> float:
        ids = SyntheticRequests(SPEC, seed=4, zipf_alpha=alpha).batch(50_000)[1][:, 1, 0].numpy()
        return np.sort(np.bincount(ids, minlength=1000))[::-1][:10].sum() / ids.size

    assert top_share(0.6) < top_share(1.05) < top_share(1.5)


def test_hot_ids_differ_between_tables_of_the_same_size() -> None:
    spec = preset_spec("tiny")
    sparse = SyntheticRequests(spec, seed=5).batch(20_000)[1]
    same_size = [table for table, rows in enumerate(spec.table_sizes) if rows == 1000]
    hottest = {int(np.bincount(sparse[:, table, 0].numpy()).argmax()) for table in same_size}
    assert len(hottest) > 1


def test_every_id_of_a_small_table_is_reachable() -> None:
    sparse = SyntheticRequests(SPEC, seed=6).batch(5000)[1]
    assert set(sparse[:, 0, 0].tolist()) == {0, 1, 2}


def test_a_criteo_kaggle_batch_needs_no_table_sized_work() -> None:
    """10M-row tables: ids come from a closed-form inverse CDF and a multiplicative bijection (no permutation)."""
    spec = preset_spec("criteo-kaggle")
    sparse = SyntheticRequests(spec, seed=0, max_hotness=2).batch(1024)[1]
    for table, rows in enumerate(spec.table_sizes):
        assert sparse[:, table].max() < rows
    assert sparse[:, 2].max() > 1_000_000  # the 10M-row table is used beyond its first million ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"zipf_alpha": 0.0}, "zipf_alpha must be > 0"), ({"max_hotness": 0}, "max_hotness must be >= 1")],
)
def test_bad_parameters_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticRequests(SPEC, **kwargs)


def test_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="rows must be >= 1"):
        SyntheticRequests(SPEC).batch(0)
