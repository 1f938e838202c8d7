"""Synthetic requests: the DLRM presets' (shapes, padding layout, determinism, power-law ids) and a signature's
(datatypes, ids within each position's table, shared per-table skew, variable sizes) (no Ray)."""

import hashlib

import numpy as np
import pytest
import torch

from disagg.id_ranges import IdRange
from disagg.signature import InputSignature, ModelSignature
from disagg.spec import DLRMSpec, preset_spec
from disagg.synthetic import SignatureRequests, SyntheticRequests

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
    assert first.power_law.offsets == second.power_law.offsets
    assert np.array_equal(first._count_means, second._count_means)
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
    """Each table has a popularity order of its own: no two tables of one size share their ten hottest ids."""
    spec = preset_spec("tiny")
    sparse = SyntheticRequests(spec, seed=5).batch(20_000)[1]
    same_size = [table for table, rows in enumerate(spec.table_sizes) if rows == 1000]
    assert len(same_size) >= 3
    hottest = [frozenset(np.argsort(np.bincount(sparse[:, table, 0].numpy(), minlength=1000))[::-1][:10].tolist())
               for table in same_size]
    assert len(set(hottest)) == len(same_size)


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


def _digest(*tensors: torch.Tensor) -> str:
    return hashlib.sha256(b"".join(tensor.numpy().tobytes() for tensor in tensors)).hexdigest()[:16]


@pytest.mark.parametrize(
    ("kwargs", "digest"),
    [
        ({"seed": 0}, "b1fa1ffce668abd1"),
        ({"seed": 7, "max_hotness": 3, "zipf_alpha": 1.0}, "77e2cd0e197db098"),
        ({"seed": 4, "max_hotness": 2, "zipf_alpha": 0.8, "stream": 1}, "656793740c93c06a"),
    ],
)
def test_the_preset_generator_draws_the_rows_it_always_drew(kwargs: dict, digest: str) -> None:
    """The trained `tiny` weights and the recorded benchmarks were drawn from this stream: it must not change."""
    requests = SyntheticRequests(preset_spec("tiny"), **kwargs)
    assert _digest(*requests.batch(16), *requests.batch(5)) == digest


SIGNATURE = ModelSignature(
    inputs=[
        InputSignature(name="dense", datatype="FP32", shape=[-1, 3]),
        InputSignature(name="ids", datatype="INT64", shape=[-1, 2]),
        InputSignature(name="history", datatype="INT32", shape=[-1, -1], pad_value=-1),
        InputSignature(name="flags", datatype="BOOL", shape=[-1, 4]),
        InputSignature(name="scores", datatype="FP16", shape=[-1, -1, 2]),
    ]
)
#: As ``disagg.id_ranges`` gives them: ``ids`` holds a user (a 50-row table) and an item (1000 rows), ``history`` items.
RANGES = {
    "ids": IdRange(0, np.array([[50, 1000]]), np.array([["users", "items"]], dtype=object)),
    "history": IdRange(-1, np.array([[1000]]), np.array([["items"]], dtype=object)),
}


def test_signature_batches_have_each_inputs_datatype_and_shape() -> None:
    batch = SignatureRequests(SIGNATURE, RANGES, seed=1, variable_size=5).batch(64)
    assert list(batch) == ["dense", "ids", "history", "flags", "scores"]
    expected = {"dense": ((64, 3), torch.float32), "ids": ((64, 2), torch.int64), "history": ((64, 5), torch.int32),
                "flags": ((64, 4), torch.bool), "scores": ((64, 5, 2), torch.float16)}
    assert {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in batch.items()} == expected
    for name in ("dense", "scores"):
        values = batch[name].float()
        assert torch.isfinite(values).all() and (values >= 0).all() and values.std() > 0.1
    assert 0 < int(batch["flags"].sum()) < batch["flags"].numel()


def test_signature_ids_stay_within_the_table_of_their_position() -> None:
    batch = SignatureRequests(SIGNATURE, RANGES, seed=2, variable_size=3).batch(5000)
    users, items, history = batch["ids"][:, 0], batch["ids"][:, 1], batch["history"]
    assert int(users.min()) >= 0 and int(users.max()) < 50 and len(users.unique()) > 40
    assert int(items.min()) >= 0 and int(items.max()) < 1000 and int(items.max()) >= 500
    assert int(history.min()) >= 0 and int(history.max()) < 1000


def test_signature_ids_are_power_law_with_one_bijection_per_table() -> None:
    batch = SignatureRequests(SIGNATURE, RANGES, seed=3, variable_size=10).batch(20_000)
    counts = np.bincount(batch["history"].reshape(-1).numpy(), minlength=1000)
    assert counts.max() > 20 * np.median(counts)
    # the item table's hot ids are the same wherever it is indexed: in `ids` and in `history`
    hottest_items = np.bincount(batch["ids"][:, 1].numpy(), minlength=1000).argmax()
    assert hottest_items == counts.argmax() != 0


def test_larger_alpha_gives_more_skewed_signature_ids() -> None:
    def top_share(alpha: float) -> float:
        ids = SignatureRequests(SIGNATURE, RANGES, seed=4, zipf_alpha=alpha).batch(50_000)["ids"][:, 1].numpy()
        return np.sort(np.bincount(ids, minlength=1000))[::-1][:10].sum() / ids.size

    assert top_share(0.6) < top_share(1.0) < top_share(1.5)


def test_signature_requests_are_seeded_and_streams_share_the_distribution() -> None:
    def batches(**kwargs) -> list[dict[str, torch.Tensor]]:
        requests = SignatureRequests(SIGNATURE, RANGES, variable_size=2, **kwargs)
        return [requests.batch(32), requests.batch(32)]

    def same(first: list[dict[str, torch.Tensor]], second: list[dict[str, torch.Tensor]], name: str) -> bool:
        return all(torch.equal(a[name], b[name]) for a, b in zip(first, second, strict=True))

    first = batches(seed=5)
    assert all(same(first, batches(seed=5), name) for name in first[0])
    assert not any(same(first, batches(seed=6), name) for name in ("dense", "ids", "history", "scores"))
    streams = [SignatureRequests(SIGNATURE, RANGES, seed=5, stream=stream) for stream in (0, 1)]
    assert streams[0].power_law.offsets == streams[1].power_law.offsets
    assert not torch.equal(streams[0].batch(32)["ids"], streams[1].batch(32)["ids"])
    assert same(batches(seed=5, stream=1), batches(seed=5, stream=1), "ids")


def test_positions_that_index_no_table_are_zero() -> None:
    unused = IdRange(0, np.array([[50, np.iinfo(np.int64).max]]), np.array([["users", None]], dtype=object))
    batch = SignatureRequests(SIGNATURE, {**RANGES, "ids": unused}, seed=7).batch(100)
    assert (batch["ids"][:, 1] == 0).all() and len(batch["ids"][:, 0].unique()) > 10


def test_an_integer_input_without_an_id_range_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"integer input 'history' has no id range"):
        SignatureRequests(SIGNATURE, {"ids": RANGES["ids"]})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"zipf_alpha": 0.0}, "zipf_alpha must be > 0"), ({"variable_size": 0}, "variable_size must be >= 1")],
)
def test_bad_signature_parameters_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SignatureRequests(SIGNATURE, RANGES, **kwargs)


def test_an_empty_signature_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="rows must be >= 1"):
        SignatureRequests(SIGNATURE, RANGES).batch(0)
