"""torch.fx partitioner: the embedding / dense cut, pooling fetched table rows, parts built alone from a meta model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disagg.id_space import stack_tables
from disagg.model import DLRM, build_preset
from disagg.model_source import PresetSource
from disagg.partition import (
    _MAX_REPEATS,
    EmbeddingLookups,
    Partition,
    UniqueIds,
    build_dense_part,
    dense_stages,
    embedding_lookups,
    partition_embeddings,
    pool_bags,
)
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests

SEED = 0


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


def test_model_without_embeddings_is_refused() -> None:
    with pytest.raises(ValueError, match="Sequential has no embedding operator"):
        partition_embeddings(nn.Sequential(nn.Linear(4, 2), nn.ReLU()))


def test_dense_part_built_alone_from_meta_holds_no_table(model: DLRM, partition: Partition) -> None:
    built = build_dense_part(PresetSource("tiny", SEED))
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


def fetched_rows(model: nn.Module, lookups: EmbeddingLookups, unique: UniqueIds) -> dict[int, torch.Tensor]:
    """What a cache or shard would return: per width, the rows of its unique ids, table after table."""
    return {group.dim: torch.cat([model.get_submodule(table).weight.detach()[lookups.table_ids(unique, table)]
                                  for table in group.tables]) for group in lookups.space.groups}


@pytest.mark.parametrize("max_hotness", [1, 4])
def test_lookups_built_from_meta_pool_fetched_rows_bit_equal_to_the_embedding_part(
    model: DLRM, partition: Partition, max_hotness: int
) -> None:
    lookups = embedding_lookups(build_dense_part(PresetSource("tiny", SEED)))  # tables on meta: shapes only
    assert lookups.inputs == ("sparse",)
    assert lookups.op_tables == {f"embeddings_{t}": f"embeddings.{t}" for t in range(model.spec.num_tables)}
    assert lookups.tables == {f"embeddings.{t}": (rows, model.spec.embedding_dim)
                              for t, rows in enumerate(model.spec.table_sizes)}
    assert not list(lookups.pool.parameters()) and not list(lookups.ids.parameters())
    dense, sparse = SyntheticRequests(model.spec, seed=1, max_hotness=max_hotness).batch(32)
    assert bool((sparse == -1).any()) == (max_hotness > 1)
    with torch.inference_mode():
        unique = lookups.unique_ids({"sparse": sparse})
        pooled = lookups({"sparse": sparse}, unique, fetched_rows(model, lookups, unique))
        expected = partition.embedding_part(sparse=sparse)
        assert list(pooled) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(pooled[name], tensor), name
        torch.testing.assert_close(partition.dense_part(dense=dense, **pooled), model(dense, sparse), rtol=0, atol=1e-6)


def test_unique_ids_deduplicate_each_table_and_index_back_every_id(model: DLRM) -> None:
    lookups = embedding_lookups(partition_embeddings(model))
    _, sparse = SyntheticRequests(model.spec, seed=4, max_hotness=4).batch(64)
    unique = lookups.unique_ids({"sparse": sparse})
    assert list(unique.groups) == [model.spec.embedding_dim]  # one width: one run of ids, one rows tensor
    group = unique.groups[model.spec.embedding_dim]
    assert group.ids.dtype == torch.int64 and bool((group.ids[1:] > group.ids[:-1]).all())  # sorted, each id once
    assert sum(group.counts) == group.ids.numel()
    assert list(unique.index) == [f"embeddings_{t}" for t in range(model.spec.num_tables)]
    duplicated = 0
    for t, table in enumerate(lookups.tables):
        used = sparse[:, t].clamp(min=0)  # what the DLRM feeds its bag (padding reads row 0 with weight 0)
        ids = lookups.table_ids(unique, table)
        assert ids.numel() == group.counts[t]
        assert set(ids.tolist()) == set(used.flatten().tolist()), table
        # the index points into the width's rows: table after table, so past every earlier table's ids
        assert torch.equal(group.ids[unique.index[f"embeddings_{t}"]] - lookups.space.base[table], used), table
        duplicated += ids.numel() < used.numel()
    assert duplicated == len(lookups.tables)  # Zipf ids repeat in every table: the dedup really shrinks the fetch


def test_unique_ids_index_every_batch_shape_right_past_the_bound_on_kept_shapes(model: DLRM) -> None:
    """The per-op constants are kept per batch shape, at most ``_MAX_REPEATS`` shapes: a shape seen again, a new
    one and one seen before the keep was emptied all index back to their own ids."""
    lookups = embedding_lookups(partition_embeddings(model))
    requests = SyntheticRequests(model.spec, seed=9, max_hotness=2)
    for rows in [*range(1, _MAX_REPEATS + 3), 1, 7, _MAX_REPEATS + 2]:
        _, sparse = requests.batch(rows)
        unique = lookups.unique_ids({"sparse": sparse})
        group = unique.groups[model.spec.embedding_dim]
        for t, table in enumerate(lookups.tables):
            got = group.ids[unique.index[f"embeddings_{t}"]] - lookups.space.base[table]
            assert torch.equal(got, sparse[:, t].clamp(min=0)), (rows, table)
        assert len(lookups._repeats_seen) <= _MAX_REPEATS


def test_out_of_range_ids_and_misshapen_rows_are_named(model: DLRM) -> None:
    lookups = embedding_lookups(partition_embeddings(model))
    sparse = torch.zeros(2, model.spec.num_tables, 1, dtype=torch.int64)
    sparse[1, 1, 0] = model.spec.table_sizes[1]
    with pytest.raises(ValueError, match=rf"table 'embeddings.1': id {model.spec.table_sizes[1]} is outside its rows"):
        lookups.unique_ids({"sparse": sparse})
    sparse[1, 1, 0] = 5
    unique = lookups.unique_ids({"sparse": sparse})
    rows = fetched_rows(model, lookups, unique)
    dim = model.spec.embedding_dim
    count = unique.groups[dim].ids.numel()
    rows[dim] = rows[dim][:, :-1]
    expected = rf"rows of width {dim} are \({count}, {dim - 1}\), expected \({count}, {dim}\)"
    with pytest.raises(ValueError, match=expected):
        lookups({"sparse": sparse}, unique, rows)
    with pytest.raises(ValueError, match=rf"no unique ids or rows for the tables of width {dim}"):
        lookups({"sparse": sparse}, unique, {})


class MixedLookups(nn.Module):
    """One nn.Embedding looked up twice (query and title tokens), a mean bag over offsets (with an empty bag) and a
    max bag with padding_idx and include_last_offset."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(40, 6, padding_idx=0)
        self.tags = nn.EmbeddingBag(30, 6, mode="mean")
        self.sites = nn.EmbeddingBag(20, 6, mode="max", padding_idx=3, include_last_offset=True)
        self.head = nn.Linear(4 * 6, 1)
        generator = torch.Generator().manual_seed(0)
        for table in (self.words, self.tags, self.sites):  # padding rows too: a lookup returns them as stored
            nn.init.normal_(table.weight, generator=generator)

    def forward(self, query: torch.Tensor, title: torch.Tensor, tags: torch.Tensor, tag_offsets: torch.Tensor,
                sites: torch.Tensor, site_offsets: torch.Tensor) -> torch.Tensor:
        vectors = [self.words(query).sum(1), self.words(title).mean(1), self.tags(tags, tag_offsets),
                   self.sites(sites, site_offsets)]
        return self.head(torch.cat(vectors, dim=1))


def mixed_inputs(padding: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    sites = torch.randint(0, 20, (9,), generator=generator)
    sites[sites == 3] = 4
    if padding:
        sites[[1, 8]] = 3  # bag 1: the padding id among others; bag 3 (the last): the padding id alone
    return {
        "query": torch.randint(0, 40, (4, 5), generator=generator),
        "title": torch.randint(0, 40, (4, 3), generator=generator),
        "tags": torch.randint(0, 30, (7,), generator=generator),
        "tag_offsets": torch.tensor([0, 2, 2, 5]),  # bag 1 is empty
        "sites": sites,
        "site_offsets": torch.tensor([0, 1, 3, 8, 9]),
    }


@pytest.mark.parametrize("padding", [False, True])
def test_lookups_of_mixed_modules_share_a_table_and_pool_exactly(padding: bool) -> None:
    mixed = MixedLookups().eval()
    partition = partition_embeddings(mixed)
    lookups = embedding_lookups(partition)
    assert lookups.op_tables == {"words": "words", "words_1": "words", "tags_1": "tags", "sites_1": "sites"}
    assert lookups.tables == {"words": (40, 6), "tags": (30, 6), "sites": (20, 6)}
    assert lookups.padding == {"sites_1": 3}  # the inputs `tags` and `sites` took the plain node names
    inputs = mixed_inputs(padding)
    with torch.inference_mode():
        unique = lookups.unique_ids(inputs)
        words = lookups.table_ids(unique, "words")
        group = unique.groups[6]
        assert words.tolist() == sorted({*inputs["query"].flatten().tolist(), *inputs["title"].flatten().tolist()})
        assert torch.equal(group.ids[unique.index["words"]], inputs["query"])
        assert torch.equal(group.ids[unique.index["words_1"]], inputs["title"])
        assert (3 in lookups.table_ids(unique, "sites").tolist()) == padding
        pooled = lookups(inputs, unique, fetched_rows(mixed, lookups, unique))
        expected = partition.embedding_part(**{name: inputs[name] for name in partition.embedding_inputs})
        assert list(pooled) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(pooled[name], tensor), name
        output = partition.dense_part(**{name: inputs[name] for name in partition.dense_inputs}, **pooled)
        torch.testing.assert_close(output, mixed(**inputs), rtol=0, atol=1e-6)


def pool_calls(lookups: EmbeddingLookups) -> list[torch.fx.Node]:
    return [node for node in lookups.pool.graph.nodes
            if node.op == "call_function" and node.target in (pool_bags, F.embedding_bag)]


def test_the_dlrm_bags_pool_in_one_call(model: DLRM) -> None:
    lookups = embedding_lookups(partition_embeddings(model))
    (fused,) = pool_calls(lookups)
    assert fused.target is pool_bags and len(fused.args[1]) == model.spec.num_tables


class TwoWidths(nn.Module):
    """Two tables of width 8 (bags of 3 and of 2 ids) and two of width 4 (weighted bags of 2 ids, the second
    weighted by the first's output), so fusion meets unequal bag sizes, a dependency and a second width."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.ModuleList(nn.EmbeddingBag(rows, 8, mode="sum") for rows in (30, 20))
        self.narrow = nn.ModuleList(nn.EmbeddingBag(rows, 4, mode="sum") for rows in (10, 50))
        generator = torch.Generator().manual_seed(3)
        for table in [*self.wide, *self.narrow]:
            nn.init.normal_(table.weight, generator=generator)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        first = self.narrow[0](c, per_sample_weights=torch.ones_like(c, dtype=torch.float32))
        second = self.narrow[1](d, per_sample_weights=first[:, :2])
        return torch.cat([self.wide[0](a), self.wide[1](b), first, second], dim=1)


def test_fusion_keeps_unequal_bags_and_dependent_bags_exact_across_two_widths() -> None:
    module = TwoWidths().eval()
    partition = partition_embeddings(module)
    lookups = embedding_lookups(partition)
    assert [group.dim for group in lookups.space.groups] == [4, 8]  # in the order the forward first uses them
    assert lookups.space.base == {"narrow.0": 0, "narrow.1": 10, "wide.0": 60, "wide.1": 90}
    calls = pool_calls(lookups)
    assert [call.target for call in calls].count(pool_bags) == 1  # the two wide bags; the narrow ones depend
    generator = torch.Generator().manual_seed(11)
    inputs = {name: torch.randint(0, rows, (5, size), generator=generator)
              for name, rows, size in (("a", 30, 3), ("b", 20, 2), ("c", 10, 2), ("d", 50, 2))}
    with torch.inference_mode():
        unique = lookups.unique_ids(inputs)
        wide = unique.groups[8]
        assert wide.ids.min() >= 60  # the second width's run, indexed from its own start
        assert torch.equal(wide.ids[unique.index["wide_1"]] - lookups.space.base["wide.1"], inputs["b"])
        pooled = lookups(inputs, unique, fetched_rows(module, lookups, unique))
        expected = partition.embedding_part(**inputs)
        assert list(pooled) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(pooled[name], tensor), name


class Renormalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Embedding(10, 4)
        self.capped = nn.EmbeddingBag(10, 4, max_norm=1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.plain(ids).sum(1) + self.capped(ids)


class Chained(nn.Module):
    """The second lookup's ids come from the first lookup's output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Embedding(10, 5)
        self.second = nn.Embedding(5, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(ids).argmax(-1))


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (Renormalized(), r"embedding module 'capped' sets max_norm"),
        (DeepFM(), r"F.embedding over 'table': .* with an nn.Embedding / nn.EmbeddingBag module"),
        (Chained(), r"the ids of an embedding lookup depend on the lookup 'first'"),
    ],
)
def test_lookups_the_dense_side_cannot_reproduce_are_refused(module: nn.Module, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        embedding_lookups(partition_embeddings(module))


@pytest.mark.parametrize("build", ["dlrm", "two_widths", "mixed"])
def test_stacked_tables_pool_bit_equal_to_the_embedding_part_and_leave_the_model_unchanged(build: str) -> None:
    if build == "dlrm":
        spec = preset_spec("tiny")
        module = DLRM(spec, seed=SEED).eval()
        dense, sparse = SyntheticRequests(spec, seed=2, max_hotness=4).batch(16)
        inputs = {"dense": dense, "sparse": sparse}
    elif build == "two_widths":
        module = TwoWidths().eval()
        generator = torch.Generator().manual_seed(5)
        inputs = {name: torch.randint(0, rows, (5, size), generator=generator)
                  for name, rows, size in (("a", 30, 3), ("b", 20, 2), ("c", 10, 2), ("d", 50, 2))}
    else:
        module, inputs = MixedLookups().eval(), mixed_inputs(padding=True)
    partition = partition_embeddings(module)
    lookups = embedding_lookups(partition)
    with torch.inference_mode():
        before = module(**inputs)
        tables = stack_tables(module, lookups.space)
        assert sorted(tables) == sorted(group.dim for group in lookups.space.groups)
        for table in lookups.tables:  # each module's weight now views its width's stack
            weight = module.get_submodule(table).weight
            assert weight.untyped_storage().data_ptr() == tables[weight.shape[1]].untyped_storage().data_ptr()
        embedding_inputs = {name: inputs[name] for name in partition.embedding_inputs}
        pooled = lookups.pool_tables(embedding_inputs, tables)
        expected = partition.embedding_part(**embedding_inputs)
        assert list(pooled) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(pooled[name], tensor), name
        after = module(**inputs)
        assert torch.equal(after, before)


def test_pool_tables_names_the_table_of_an_id_past_its_rows() -> None:
    model = DLRM(preset_spec("tiny"), seed=SEED).eval()  # its own: stacking moves the weights
    lookups = embedding_lookups(partition_embeddings(model))
    tables = stack_tables(model, lookups.space)
    sparse = torch.zeros(2, model.spec.num_tables, 1, dtype=torch.int64)
    sparse[0, 3, 0] = model.spec.table_sizes[3]  # would read the next table's first row
    with pytest.raises(ValueError, match=rf"table 'embeddings.3': id {model.spec.table_sizes[3]} is outside its rows"):
        lookups.pool_tables({"sparse": sparse}, tables)
