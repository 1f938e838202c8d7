"""DLRM model: preset specs, deterministic weights, forward semantics (no Ray)."""

import pytest
import torch

from disagg.model import CRITEO_KAGGLE_TABLE_SIZES, DLRM, PRESETS, DLRMSpec, build_preset, preset_spec


@pytest.fixture(scope="module")
def tiny() -> DLRM:
    return build_preset("tiny").eval()


def random_inputs(spec: DLRMSpec, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, spec.num_dense, generator=generator)
    sparse = torch.stack(
        [torch.randint(0, size, (rows,), generator=generator) for size in spec.table_sizes], dim=1
    )
    return dense, sparse


def test_criteo_kaggle_spec_matches_the_data_set() -> None:
    spec = preset_spec("criteo-kaggle")
    assert spec.num_dense == 13
    assert spec.num_tables == 26
    assert spec.table_sizes == CRITEO_KAGGLE_TABLE_SIZES
    assert spec.total_rows == 33_762_577  # "33.76M rows"
    assert spec.bottom_mlp == (512, 256, 64, 16)
    assert spec.top_mlp == (512, 256, 1)
    # 27 vectors (bottom output + 26 embeddings) give 27*26/2 = 351 pairs, plus the 16-wide bottom output.
    assert spec.interaction_width == 367


def test_tiny_caps_every_table_at_1000_rows_and_keeps_the_shape() -> None:
    tiny_spec, full = preset_spec("tiny"), preset_spec("criteo-kaggle")
    assert tiny_spec.table_sizes == tuple(min(size, 1000) for size in full.table_sizes)
    assert max(tiny_spec.table_sizes) == 1000
    assert 3 in tiny_spec.table_sizes  # small tables are not inflated
    assert (tiny_spec.num_dense, tiny_spec.embedding_dim, tiny_spec.bottom_mlp, tiny_spec.top_mlp) == (
        full.num_dense, full.embedding_dim, full.bottom_mlp, full.top_mlp
    )


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown DLRM preset 'huge'") as error:
        build_preset("huge")
    for name in PRESETS:
        assert name in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"bottom_mlp": (64, 8)}, "bottom_mlp must end in embedding_dim"),
        ({"top_mlp": (32, 2)}, "top_mlp must end in 1"),
        ({"table_sizes": ()}, "table_sizes"),
        ({"table_sizes": (10, 0)}, "table_sizes"),
        ({"num_dense": 0}, "num_dense"),
    ],
)
def test_spec_validation(overrides: dict, message: str) -> None:
    fields = {"num_dense": 4, "table_sizes": (10, 20), "embedding_dim": 4, "bottom_mlp": (8, 4),
              "top_mlp": (8, 1)} | overrides
    with pytest.raises(ValueError, match=message):
        DLRMSpec(**fields)


def test_spec_normalises_lists_to_tuples() -> None:
    spec = DLRMSpec(num_dense=2, table_sizes=[5, 6], embedding_dim=3, bottom_mlp=[3], top_mlp=[1])
    assert spec.table_sizes == (5, 6)
    assert hash(spec) == hash(DLRMSpec(2, (5, 6), 3, (3,), (1,)))


def test_same_seed_gives_bit_identical_weights(tiny: DLRM) -> None:
    again = build_preset("tiny", seed=0)
    assert tiny.state_dict().keys() == again.state_dict().keys()
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_different_seeds_give_different_weights(tiny: DLRM) -> None:
    other = build_preset("tiny", seed=1).state_dict()
    for name, tensor in tiny.state_dict().items():
        assert not torch.equal(tensor, other[name]), name


def test_layer_widths_follow_the_spec(tiny: DLRM) -> None:
    spec = tiny.spec
    bottom = [layer for layer in tiny.bottom_mlp if isinstance(layer, torch.nn.Linear)]
    top = [layer for layer in tiny.top_mlp if isinstance(layer, torch.nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in bottom] == [
        (13, 512), (512, 256), (256, 64), (64, 16)
    ]
    assert [(layer.in_features, layer.out_features) for layer in top] == [(367, 512), (512, 256), (256, 1)]
    assert [bag.num_embeddings for bag in tiny.embeddings] == list(spec.table_sizes)
    assert all(bag.mode == "sum" for bag in tiny.embeddings)
    # ReLU after every bottom layer (as the reference DLRM); the last top layer is linear, sigmoid follows.
    assert [type(layer).__name__ for layer in tiny.bottom_mlp] == ["Linear", "ReLU"] * 4
    assert [type(layer).__name__ for layer in tiny.top_mlp] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]


def test_forward_gives_one_probability_per_row(tiny: DLRM) -> None:
    dense, sparse = random_inputs(tiny.spec, rows=7)
    with torch.inference_mode():
        probabilities = tiny(dense, sparse)
    assert probabilities.shape == (7, 1)
    assert probabilities.dtype == torch.float32
    assert ((probabilities > 0) & (probabilities < 1)).all()
    assert probabilities.unique().numel() > 1  # rows are not collapsed to one value


def test_one_hot_lookup_returns_the_table_rows(tiny: DLRM) -> None:
    _, sparse = random_inputs(tiny.spec, rows=5)
    with torch.inference_mode():
        pooled = tiny.embed_one_hot(sparse)
    assert len(pooled) == tiny.spec.num_tables
    for table, (bag, vectors) in enumerate(zip(tiny.embeddings, pooled, strict=True)):
        assert torch.equal(vectors, bag.weight[sparse[:, table]])


def test_interaction_is_bottom_output_then_lower_triangle_dot_products(tiny: DLRM) -> None:
    generator = torch.Generator().manual_seed(3)
    bottom_out = torch.randn(2, 16, generator=generator)
    pooled = [torch.randn(2, 16, generator=generator) for _ in range(26)]
    with torch.inference_mode():
        interaction = tiny.interact(bottom_out, pooled)
    assert interaction.shape == (2, tiny.spec.interaction_width)
    vectors = [bottom_out, *pooled]
    expected_pairs = [(vectors[i] * vectors[j]).sum(dim=1) for i in range(len(vectors)) for j in range(i)]
    torch.testing.assert_close(interaction[:, :16], bottom_out)
    torch.testing.assert_close(interaction[:, 16:], torch.stack(expected_pairs, dim=1))


def test_rows_do_not_influence_each_other(tiny: DLRM) -> None:
    dense, sparse = random_inputs(tiny.spec, rows=6)
    with torch.inference_mode():
        batched = tiny(dense, sparse)
        one_by_one = torch.cat([tiny(dense[i : i + 1], sparse[i : i + 1]) for i in range(6)])
    torch.testing.assert_close(batched, one_by_one)


def test_model_traces_with_torch_fx(tiny: DLRM) -> None:
    """The graph partitioner works on torch.fx graphs, so the forward must trace and stay equal."""
    traced = torch.fx.symbolic_trace(tiny)
    targets = {node.target for node in traced.graph.nodes if node.op == "call_module"}
    assert {f"embeddings.{t}" for t in range(tiny.spec.num_tables)} <= targets
    dense, sparse = random_inputs(tiny.spec, rows=4)
    with torch.inference_mode():
        assert torch.equal(traced(dense, sparse), tiny(dense, sparse))
