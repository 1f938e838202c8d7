"""DLRM model: preset specs, per-module deterministic weights, meta build, multi-hot forward (no Ray)."""

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from disagg.model import DLRM, build_preset, materialize_
from disagg.spec import CRITEO_KAGGLE_TABLE_SIZES, PRESETS, DLRMSpec, preset_spec


@pytest.fixture(scope="module")
def tiny() -> DLRM:
    return build_preset("tiny").eval()


def random_inputs(spec: DLRMSpec, rows: int, hotness: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense features and sparse ids [rows, tables, hotness]; with hotness > 1 about a third of slots are -1."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, spec.num_dense, generator=generator)
    sparse = torch.stack(
        [torch.randint(0, size, (rows, hotness), generator=generator) for size in spec.table_sizes], dim=1
    )
    if hotness > 1:
        sparse[torch.rand(sparse.shape, generator=generator) < 0.35] = -1
    return dense, sparse


def reference_forward(model: DLRM, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """DLRM written out by hand: loops over bags, explicit pairs, explicit matrix products."""

    def mlp(x: torch.Tensor, layers: nn.Sequential, relu_last: bool) -> torch.Tensor:
        linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
        for index, layer in enumerate(linears):
            x = x @ layer.weight.T + layer.bias
            if relu_last or index < len(linears) - 1:
                x = x.clamp(min=0)
        return x

    bottom = mlp(dense, model.bottom_mlp, relu_last=True)
    pooled = []
    for table, bag in enumerate(model.embeddings):
        sums = torch.zeros(dense.shape[0], model.spec.embedding_dim)
        for row in range(dense.shape[0]):
            for index in sparse[row, table].tolist():
                if index >= 0:
                    sums[row] += bag.weight[index]
        pooled.append(sums)
    vectors = [bottom, *pooled]
    pairs = [(vectors[i] * vectors[j]).sum(dim=1) for i in range(len(vectors)) for j in range(i)]
    interaction = torch.cat([bottom, torch.stack(pairs, dim=1)], dim=1)
    return torch.sigmoid(mlp(interaction, model.top_mlp, relu_last=False))


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
        full.num_dense,
        full.embedding_dim,
        full.bottom_mlp,
        full.top_mlp,
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
    fields = {
        "num_dense": 4,
        "table_sizes": (10, 20),
        "embedding_dim": 4,
        "bottom_mlp": (8, 4),
        "top_mlp": (8, 1),
    } | overrides
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


def test_tables_of_the_same_size_get_different_values(tiny: DLRM) -> None:
    same_size = [bag.weight for bag in tiny.embeddings if bag.num_embeddings == 1000]
    assert len(same_size) > 2
    assert not any(torch.equal(same_size[0], other) for other in same_size[1:])


def test_initialisation_follows_the_reference_dlrm(tiny: DLRM) -> None:
    for bag in tiny.embeddings:
        bound = math.sqrt(1.0 / bag.num_embeddings)
        assert bag.weight.abs().max() <= bound
        assert bag.weight.abs().max() > 0.9 * bound
    layer = tiny.top_mlp[0]  # 367 -> 512: enough samples for the standard deviation
    expected = math.sqrt(2.0 / (367 + 512))
    assert abs(layer.weight.std().item() - expected) < 0.02 * expected
    assert abs(layer.bias.std().item() - math.sqrt(1.0 / 512)) < 0.15 * math.sqrt(1.0 / 512)


def test_meta_build_allocates_no_parameter_and_materializes_bit_identically(tiny: DLRM) -> None:
    model = DLRM(tiny.spec, seed=0, device="meta")
    assert all(parameter.is_meta for parameter in model.parameters())
    materialize_(model, seed=0)
    assert all(parameter.device.type == "cpu" for parameter in model.parameters())
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    dense, sparse = random_inputs(tiny.spec, rows=5, hotness=3)
    with torch.inference_mode():
        assert torch.equal(model(dense, sparse), tiny(dense, sparse))


def test_materializing_a_part_gives_the_full_models_values(tiny: DLRM) -> None:
    """A GraphModule holding two tables and one top layer of a meta model: only those, at their full values."""
    graph = torch.fx.Graph()
    ids, hidden = graph.placeholder("ids"), graph.placeholder("hidden")
    outputs = [graph.call_module(f"embeddings.{table}", (ids,)) for table in (2, 17)]
    graph.output((*outputs, graph.call_module("top_mlp.2", (hidden,))))
    part = torch.fx.GraphModule(DLRM(tiny.spec, seed=0, device="meta"), graph)
    materialize_(part, seed=0)
    full = dict(tiny.named_parameters())
    held = dict(part.named_parameters())
    assert set(held) == {"embeddings.2.weight", "embeddings.17.weight", "top_mlp.2.weight", "top_mlp.2.bias"}
    for name, tensor in held.items():
        assert torch.equal(tensor, full[name]), name


def test_materialize_reinitialises_cpu_parameters_in_place(tiny: DLRM) -> None:
    model = DLRM(tiny.spec, seed=4)
    table = model.embeddings[2].weight
    storage = table.data_ptr()
    materialize_(model, seed=0)
    assert model.embeddings[2].weight is table and table.data_ptr() == storage  # no second copy of a table
    assert torch.equal(table, tiny.embeddings[2].weight)


def test_materialize_refuses_layers_it_cannot_initialise() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    with pytest.raises(ValueError, match=r"still on meta: \['1.weight', '1.bias'\]"):
        materialize_(model, seed=0)


def test_layer_widths_follow_the_spec(tiny: DLRM) -> None:
    spec = tiny.spec
    bottom = [layer for layer in tiny.bottom_mlp if isinstance(layer, torch.nn.Linear)]
    top = [layer for layer in tiny.top_mlp if isinstance(layer, torch.nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in bottom] == [
        (13, 512), (512, 256), (256, 64), (64, 16)
    ]  # fmt: skip
    assert [(layer.in_features, layer.out_features) for layer in top] == [(367, 512), (512, 256), (256, 1)]
    assert [bag.num_embeddings for bag in tiny.embeddings] == list(spec.table_sizes)
    assert all(bag.mode == "sum" for bag in tiny.embeddings)
    # ReLU after every bottom layer (as the reference DLRM); the last top layer is linear, sigmoid follows.
    assert [type(layer).__name__ for layer in tiny.bottom_mlp] == ["Linear", "ReLU"] * 4
    assert [type(layer).__name__ for layer in tiny.top_mlp] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]


@pytest.mark.parametrize("hotness", [1, 4])
def test_forward_equals_the_reference_dlrm(tiny: DLRM, hotness: int) -> None:
    dense, sparse = random_inputs(tiny.spec, rows=6, hotness=hotness, seed=hotness)
    with torch.inference_mode():
        probabilities = tiny(dense, sparse)
        expected = reference_forward(tiny, dense, sparse)
    assert probabilities.shape == (6, 1)
    assert probabilities.dtype == torch.float32
    assert ((probabilities > 0) & (probabilities < 1)).all()
    assert probabilities.unique().numel() > 1  # rows are not collapsed to one value
    torch.testing.assert_close(probabilities, expected, rtol=1e-5, atol=1e-6)


def test_padding_is_ignored_and_an_empty_bag_pools_to_zero(tiny: DLRM) -> None:
    dense, one_hot = random_inputs(tiny.spec, rows=4, hotness=1, seed=7)
    padded = torch.cat([one_hot, torch.full_like(one_hot, -1)], dim=2)[:, :, [1, 0]]  # -1 first, id second
    empty = one_hot.clone()
    empty[:, 5] = -1
    zeroed = tiny.embeddings[5].weight.detach().clone()
    with torch.inference_mode():
        torch.testing.assert_close(tiny(dense, padded), tiny(dense, one_hot), rtol=0, atol=1e-7)
        assert not torch.allclose(tiny(dense, empty), tiny(dense, one_hot))
        torch.testing.assert_close(tiny(dense, empty), reference_forward(tiny, dense, empty), rtol=1e-5, atol=1e-6)
    assert torch.equal(tiny.embeddings[5].weight, zeroed)  # padding never writes to the table


def test_a_bag_sums_its_ids(tiny: DLRM) -> None:
    """A row whose bag holds ids a and b equals the model with table row a replaced by row a + row b."""
    dense, sparse = random_inputs(tiny.spec, rows=1, hotness=1, seed=2)
    pair = torch.cat([sparse, torch.full_like(sparse, -1)], dim=2)
    pair[0, 3, 1] = 7
    model = DLRM(tiny.spec, seed=0)
    with torch.inference_mode():
        together = model(dense, pair)
        model.embeddings[3].weight[sparse[0, 3, 0]] += model.embeddings[3].weight[7]
        torch.testing.assert_close(together, model(dense, sparse), rtol=1e-5, atol=1e-7)


def test_rows_do_not_influence_each_other(tiny: DLRM) -> None:
    dense, sparse = random_inputs(tiny.spec, rows=6, hotness=3)
    with torch.inference_mode():
        batched = tiny(dense, sparse)
        one_by_one = torch.cat([tiny(dense[i : i + 1], sparse[i : i + 1]) for i in range(6)])
    torch.testing.assert_close(batched, one_by_one)


def test_model_traces_with_torch_fx_even_on_meta(tiny: DLRM) -> None:
    """The graph partitioner works on torch.fx graphs, so the forward must trace (with no data) and stay equal."""
    traced = torch.fx.symbolic_trace(DLRM(tiny.spec, device="meta"))
    targets = {node.target for node in traced.graph.nodes if node.op == "call_module"}
    assert {f"embeddings.{t}" for t in range(tiny.spec.num_tables)} <= targets
    traced = torch.fx.symbolic_trace(tiny)
    dense, sparse = random_inputs(tiny.spec, rows=4, hotness=2)
    with torch.inference_mode():
        assert torch.equal(traced(dense, sparse), tiny(dense, sparse))


def test_building_the_model_or_any_part_never_imports_sympy() -> None:
    """A meta skeleton given values (whole, its dense part, one shard) never runs an op on a meta tensor: torch's
    Python references would import sympy and symbolic shapes, tens of MiB in every replica process."""
    code = (
        "import sys\n"
        "from disagg.model import DLRM\n"
        "from disagg.model_source import PresetSource\n"
        "from disagg.partition import build_dense_part\n"
        "from disagg.spec import preset_spec\n"
        "from disagg.tables import TableLayout, build_embedding_shard\n"
        "assert 'sympy' not in sys.modules\n"
        "DLRM(preset_spec('tiny'))\n"
        "build_dense_part(PresetSource('tiny', 0))\n"
        "build_embedding_shard(PresetSource('tiny', 0), 0, TableLayout(2))\n"
        "heavy = ('sympy', 'mpmath', 'torch.fx.experimental.symbolic_shapes')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
