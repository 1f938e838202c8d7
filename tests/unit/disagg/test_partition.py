"""torch.fx partitioner: the embedding / dense cut, table-wise shards, parts built alone from a meta model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disagg.model import DLRM, build_preset
from disagg.partition import Partition, build_dense_part, build_embedding_shard, dense_stages, partition_embeddings
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests

SEED = 3


@pytest.fixture(scope="module")
def model() -> DLRM:
    return DLRM(preset_spec("tiny"), seed=SEED).eval()


@pytest.fixture(scope="module")
def partition(model: DLRM) -> Partition:
    return partition_embeddings(model)


def dlrm_inputs(model: DLRM, rows: int, hotness: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sparse = torch.stack(
        [torch.randint(-1, size, (rows, hotness), generator=generator) for size in model.spec.table_sizes], dim=1
    )
    if hotness == 1:
        sparse = sparse.clamp(min=0)
    return {"dense": torch.randn(rows, model.spec.num_dense, generator=generator), "sparse": sparse}


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("hotness", [1, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_part_of_embedding_part_equals_the_model(
    model: DLRM, partition: Partition, hotness: int, seed: int
) -> None:
    inputs = dlrm_inputs(model, rows=8, hotness=hotness, seed=seed)
    with torch.inference_mode():
        expected = model(**inputs)
        cut = partition.embedding_part(sparse=inputs["sparse"])
        composed = partition.dense_part(dense=inputs["dense"], **cut)
        torch.testing.assert_close(composed, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(partition(**inputs), expected, rtol=0, atol=1e-6)


def test_dlrm_cut_is_the_pooled_bags(model: DLRM, partition: Partition) -> None:
    num_tables = model.spec.num_tables
    assert partition.embedding_inputs == ("sparse",)
    assert partition.dense_inputs == ("dense",)
    assert partition.cut_names == tuple(f"embeddings_{t}" for t in range(num_tables))
    with torch.inference_mode():
        cut = partition.embedding_part(sparse=dlrm_inputs(model, rows=3, hotness=4, seed=0)["sparse"])
    assert list(cut) == list(partition.cut_names)
    assert all(tensor.shape == (3, model.spec.embedding_dim) for tensor in cut.values())


def test_parts_hold_only_their_own_parameters(model: DLRM, partition: Partition) -> None:
    embedding_names = {name for name, _ in partition.embedding_part.named_parameters()}
    assert embedding_names == {f"embeddings.{t}.weight" for t in range(model.spec.num_tables)}
    dense_names = {name for name, _ in partition.dense_part.named_parameters()}
    assert dense_names == {name for name, _ in model.named_parameters() if not name.startswith("embeddings.")}
    assert not any(isinstance(m, nn.EmbeddingBag) for m in partition.dense_part.modules())


def test_missing_input_is_named(partition: Partition) -> None:
    with pytest.raises(TypeError, match=r"missing model inputs: \['dense'\]"):
        partition(sparse=torch.zeros(1, 26, 1, dtype=torch.int64))


@pytest.mark.parametrize("num_shards", [2, 3])
def test_shards_split_the_embedding_part_table_wise(model: DLRM, partition: Partition, num_shards: int) -> None:
    shards = partition.shards(num_shards)
    assert [shard.index for shard in shards] == list(range(num_shards))
    assert sorted(name for shard in shards for name in shard.output_names) == sorted(partition.cut_names)
    inputs = dlrm_inputs(model, rows=6, hotness=3, seed=num_shards)
    with torch.inference_mode():
        whole = partition.embedding_part(sparse=inputs["sparse"])
        union = {}
        for shard in shards:
            assert shard.input_names == ("sparse",)
            outputs = shard.module(sparse=inputs["sparse"])
            assert tuple(outputs) == shard.output_names
            union |= outputs
    assert union.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(union[name], tensor), name
    for shard in shards:
        tables = {name.removeprefix("embeddings_") for name in shard.output_names}
        held = {name for name, _ in shard.module.named_parameters()}
        assert held == {f"embeddings.{table}.weight" for table in tables}
        assert shard.parameter_bytes == parameter_bytes(shard.module)
    again = partition.shards(num_shards)
    assert [shard.output_names for shard in again] == [shard.output_names for shard in shards]


def test_shards_of_criteo_kaggle_are_balanced_by_bytes_on_meta() -> None:
    """Greedy largest-first: loads differ by at most the largest table, and every byte is placed once."""
    spec = preset_spec("criteo-kaggle")
    shards = partition_embeddings(DLRM(spec, device="meta")).shards(4)
    loads = [shard.parameter_bytes for shard in shards]
    assert sum(loads) == spec.total_rows * spec.embedding_dim * 4
    assert max(loads) - min(loads) <= max(spec.table_sizes) * spec.embedding_dim * 4
    assert max(loads) == max(spec.table_sizes) * spec.embedding_dim * 4  # the 10M-row table sits alone
    assert all(p.is_meta for shard in shards for p in shard.module.parameters())


@pytest.mark.parametrize("num_shards", [0, 27])
def test_bad_shard_count_is_refused(partition: Partition, num_shards: int) -> None:
    with pytest.raises(ValueError, match=r"num_shards must be between 1 and 26"):
        partition.shards(num_shards)


def test_model_without_embeddings_is_refused() -> None:
    with pytest.raises(ValueError, match="Sequential has no embedding operator"):
        partition_embeddings(nn.Sequential(nn.Linear(4, 2), nn.ReLU()))


def test_a_shard_built_alone_from_meta_holds_only_its_tables(model: DLRM, partition: Partition) -> None:
    inputs = dlrm_inputs(model, rows=5, hotness=2, seed=9)
    with torch.inference_mode():
        whole = partition.embedding_part(sparse=inputs["sparse"])
    for index in range(3):
        shard = build_embedding_shard(model.spec, seed=SEED, index=index, num_shards=3)
        tables = {int(name.removeprefix("embeddings_")) for name in shard.output_names}
        held = dict(shard.module.named_parameters())
        assert set(held) == {f"embeddings.{table}.weight" for table in tables}
        assert all(p.device.type == "cpu" for p in held.values())
        with torch.inference_mode():
            outputs = shard.module(sparse=inputs["sparse"])
        for name, tensor in outputs.items():
            assert torch.equal(tensor, whole[name]), name


def test_shard_index_is_checked(model: DLRM) -> None:
    with pytest.raises(ValueError, match=r"shard index must be in \[0, 2\), got 2"):
        build_embedding_shard(model.spec, seed=SEED, index=2, num_shards=2)


def test_dense_part_built_alone_from_meta_holds_no_table(model: DLRM, partition: Partition) -> None:
    built = build_dense_part(model.spec, seed=SEED)
    assert all(p.device.type == "cpu" for p in built.dense_part.parameters())
    assert all(p.is_meta for p in built.embedding_part.parameters())
    assert parameter_bytes(built.dense_part) == parameter_bytes(partition.dense_part)
    assert built.cut_names == partition.cut_names
    inputs = dlrm_inputs(model, rows=4, hotness=3, seed=5)
    with torch.inference_mode():
        cut = partition.embedding_part(sparse=inputs["sparse"])
        assert torch.equal(built.dense_part(dense=inputs["dense"], **cut), model(**inputs))


class DeepFM(nn.Module):
    """DeepFM over multi-hot fields of one shared table (F.embedding + masked sum pooling), a bucketised dense
    feature looked up in an nn.Embedding, and a first-order term; the dense features also feed the deep MLP."""

    def __init__(self, field_rows: tuple[int, ...] = (50, 30, 20), num_dense: int = 4, dim: int = 8) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.table = nn.Parameter(torch.randn(sum(field_rows), dim, generator=generator) * 0.3)
        self.register_buffer("field_offsets", torch.tensor([0, *field_rows[:-1]]).cumsum(0))
        self.register_buffer("boundaries", torch.tensor([-1.0, 0.0, 1.0]))
        self.buckets = nn.Embedding(4, dim)
        self.first_order = nn.Embedding(sum(field_rows), 1)
        self.deep = nn.Sequential(nn.Linear((len(field_rows) + 1) * dim + num_dense, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.clamp(min=0) + self.field_offsets.view(1, -1, 1)
        present = (ids >= 0).unsqueeze(-1).float()
        fields = (F.embedding(rows, self.table) * present).sum(dim=2)
        bucket = self.buckets(torch.bucketize(dense[:, 0].contiguous(), self.boundaries))
        vectors = torch.cat([fields, bucket.unsqueeze(1)], dim=1)
        linear = (self.first_order(rows) * present).sum(dim=(1, 2, 3))
        fm = 0.5 * (vectors.sum(dim=1) ** 2 - (vectors**2).sum(dim=1)).sum(dim=1)
        deep = self.deep(torch.cat([vectors.flatten(1), dense], dim=1)).squeeze(1)
        return torch.sigmoid(linear + fm + deep)


def deepfm_inputs(rows: int, hotness: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(-1, size, (rows, hotness), generator=generator) for size in (50, 30, 20)], 1)
    return {"dense": torch.randn(rows, 4, generator=generator), "ids": ids}


@pytest.mark.parametrize("seed", [0, 1])
def test_deepfm_composition_equals_the_model_and_cuts_after_pooling(seed: int) -> None:
    deepfm = DeepFM().eval()
    partition = partition_embeddings(deepfm)
    assert partition.embedding_inputs == ("dense", "ids")  # the bucketised feature is looked up on the CPU side
    assert partition.dense_inputs == ("dense",)
    inputs = deepfm_inputs(rows=6, hotness=7, seed=seed)
    with torch.inference_mode():
        cut = partition.embedding_part(**{name: inputs[name] for name in partition.embedding_inputs})
        expected = deepfm(**inputs)
        torch.testing.assert_close(partition(**inputs), expected, rtol=0, atol=1e-6)
    assert expected.shape == (6,)
    # Pooled field vectors [B, fields + 1, dim] and the pooled first-order term [B]; never [B, fields, H, dim].
    assert sorted(tuple(tensor.shape) for tensor in cut.values()) == [(6,), (6, 4, 8)]
    assert not any(isinstance(m, nn.Embedding) for m in partition.dense_part.modules())
    assert "table" not in dict(partition.dense_part.named_parameters())


def test_deepfm_shards_keep_a_shared_table_together() -> None:
    """The field table and the bucket table feed one output, so they form one group; first-order is the other."""
    partition = partition_embeddings(DeepFM())
    shards = partition.shards(2)
    held = [{name for name, _ in shard.module.named_parameters()} for shard in shards]
    assert held == [{"table", "buckets.weight"}, {"first_order.weight"}]
    with pytest.raises(ValueError, match="between 1 and 2"):
        partition.shards(3)


class TiedLookups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 4)
        self.other = nn.Embedding(30, 4)
        self.heads = nn.ModuleList(nn.Linear(4, 1) for _ in range(3))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        looked_up = [self.shared(a), self.shared(b), self.other(c)]
        return sum(head(x) for head, x in zip(self.heads, looked_up, strict=True))


def test_outputs_sharing_a_table_land_in_one_shard() -> None:
    partition = partition_embeddings(TiedLookups())
    assert partition.cut_names == ("shared", "shared_1", "other")
    first, second = partition.shards(2)
    assert (first.output_names, first.parameter_bytes) == (("other",), 30 * 4 * 4)
    assert (second.output_names, second.parameter_bytes) == (("shared", "shared_1"), 10 * 4 * 4)


def test_dense_stages_split_off_what_needs_no_embedding_and_compose_exactly() -> None:
    """The DLRM bottom MLP depends on no cut tensor: it becomes the early stage, run during the lookup."""
    model = build_preset("tiny").eval()
    partition = partition_embeddings(model)
    stages = dense_stages(partition)
    assert stages.early_inputs == ("dense",)
    assert {name for name, _ in stages.early.named_parameters()} == {
        name for name, _ in model.named_parameters() if name.startswith("bottom_mlp.")
    }
    assert not any(name.startswith("bottom_mlp.") for name, _ in stages.late.named_parameters())
    assert set(partition.cut_names) <= set(stages.late_inputs)
    dense, sparse = SyntheticRequests(model.spec, seed=2, max_hotness=3).batch(6)
    with torch.inference_mode():
        available = {"dense": dense, "sparse": sparse, **partition.embedding_part(sparse=sparse)}
        available |= stages.early(dense=dense)
        output = stages.late(**{name: available[name] for name in stages.late_inputs})
        torch.testing.assert_close(output, model(dense, sparse), rtol=0, atol=1e-6)
