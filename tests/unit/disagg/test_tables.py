"""Table rows on shards: the layout plan, row storage dtypes, one shard built alone, versions (no Ray)."""

import os
import re
import shutil

import pytest
import torch

import disagg.model
from disagg.model import DLRM, build_preset, materialize_
from disagg.model_source import PresetSource
from disagg.spec import preset_spec, preset_weights
from disagg.tables import (
    RowStore,
    TableLayout,
    TableSlice,
    build_embedding_shard,
    embedding_tables,
    shard_version,
    storage_bytes,
    weights_source,
)

TINY = preset_spec("tiny")
SEED = 5
#: Splits the tiny preset's tables of more than 500 rows (16 float32 columns) row-wise.
SPLIT_TINY = 500 * 16 * 4


@pytest.fixture(scope="module")
def tiny_tables() -> dict[str, tuple[int, int]]:
    return embedding_tables(DLRM(TINY, device="meta"))


@pytest.fixture(scope="module")
def full() -> DLRM:
    return build_preset("tiny", seed=SEED)


@pytest.fixture(scope="module")
def trained() -> DLRM:
    return build_preset("tiny", weights=preset_weights("tiny"))


def test_embedding_tables_lists_every_table_in_module_order(tiny_tables):
    assert list(tiny_tables) == [f"embeddings.{index}" for index in range(TINY.num_tables)]
    assert list(tiny_tables.values()) == [(rows, TINY.embedding_dim) for rows in TINY.table_sizes]


# --- plan ---


def test_whole_tables_go_largest_first_to_the_least_loaded_shard():
    tables = {"a": (100, 4), "b": (60, 4), "c": (50, 4), "d": (10, 4), "e": (10, 4)}
    plan = TableLayout(2).plan(tables)
    # a (1600 B) -> 0; b (960) -> 1; c (800) -> 1 (960 < 1600); d (160) -> 0 (1600 < 1760); e -> 0 (tie at 1760)
    assert [[piece.name for piece in shard] for shard in plan] == [["a", "d", "e"], ["b", "c"]]
    assert all(piece.whole for shard in plan for piece in shard)


def test_plan_balances_storage_bytes_not_rows():
    tables = {"a": (100, 16), "b": (100, 16), "c": (100, 16)}
    assert [[piece.name for piece in shard] for shard in TableLayout(2).plan(tables)] == [["a", "c"], ["b"]]
    layout = TableLayout(2, table_storage={"b": "int8", "c": "int8"})  # a: 6400 bytes, b and c: 2000 each
    assert [[piece.name for piece in shard] for shard in layout.plan(tables)] == [["a"], ["b", "c"]]


@pytest.mark.parametrize("num_shards", [2, 3, 5])
def test_plan_of_tiny_is_balanced_and_holds_every_table_once(tiny_tables, num_shards):
    layout = TableLayout(num_shards)
    plan = layout.plan(tiny_tables)
    names = [piece.name for shard in plan for piece in shard]
    assert sorted(names) == sorted(tiny_tables)
    loads = [sum(storage_bytes(piece.rows, piece.dim, "float32") for piece in shard) for shard in plan]
    assert max(loads) - min(loads) <= max(rows * dim * 4 for rows, dim in tiny_tables.values())
    order = list(tiny_tables)
    for shard in plan:
        assert [order.index(piece.table) for piece in shard] == sorted(order.index(piece.table) for piece in shard)


def test_plan_is_deterministic(tiny_tables):
    layout = TableLayout(3, row_wise_min_bytes=SPLIT_TINY, storage_dtype="float16")
    again = TableLayout(3, row_wise_min_bytes=SPLIT_TINY, storage_dtype="float16")
    assert layout.plan(tiny_tables) == again.plan(dict(tiny_tables)) == layout.plan(tiny_tables)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_row_wise_split_covers_every_id_exactly_once_in_near_equal_ranges(tiny_tables, num_shards):
    layout = TableLayout(num_shards, row_wise_min_bytes=SPLIT_TINY)
    plan = layout.plan(tiny_tables)
    for table, (rows, dim) in tiny_tables.items():
        held = [(shard, piece) for shard, pieces in enumerate(plan) for piece in pieces if piece.table == table]
        if rows * dim * 4 <= SPLIT_TINY:
            assert len(held) == 1 and held[0][1].whole
            continue
        covered = torch.zeros(rows, dtype=torch.int64)
        for _, piece in held:
            covered[piece.row_start : piece.row_stop] += 1
        assert bool((covered == 1).all()), table
        assert [shard for shard, _ in held] == list(range(min(num_shards, rows)))  # range i on shard i
        assert [piece.row_start for _, piece in held] == sorted(piece.row_start for _, piece in held)
        sizes = [piece.rows for _, piece in held]
        assert max(sizes) - min(sizes) <= 1
        if num_shards > 1:
            assert all(piece.name == f"{table}[{piece.row_start}:{piece.row_stop}]" for _, piece in held)


def test_table_with_fewer_rows_than_shards_leaves_the_last_shards_without_a_range():
    tables = {"t": (3, 2), **{f"w{index}": (1, 1) for index in range(4)}}
    plan = TableLayout(4, row_wise_min_bytes=7).plan(tables)
    assert [[piece.name for piece in shard if piece.table == "t"] for shard in plan] == [
        ["t[0:1]"],
        ["t[1:2]"],
        ["t[2:3]"],
        [],
    ]


def test_storage_of_uses_the_table_override_else_the_default():
    layout = TableLayout(2, storage_dtype="float16", table_storage={"embeddings.2": "int8"})
    assert layout.storage_of("embeddings.2") == "int8"
    assert layout.storage_of("embeddings.3") == "float16"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_shards": 0}, "num_shards must be >= 1, got 0"),
        ({"row_wise_min_bytes": -1}, "row_wise_min_bytes must be >= 0"),
        ({"storage_dtype": "int4"}, "storage_dtype: unknown storage dtype 'int4'; known: float32, float16, int8"),
        ({"table_storage": {"embeddings.1": "fp8"}}, "table_storage['embeddings.1']: unknown storage dtype 'fp8'"),
    ],
)
def test_invalid_layout_is_a_value_error_naming_the_field(options, message):
    with pytest.raises(ValueError) as info:
        TableLayout(**options)
    assert message in str(info.value)


def test_table_storage_naming_no_table_lists_the_known_ones(tiny_tables):
    with pytest.raises(
        ValueError,
        match=r"table_storage names no table: \['embeddings.99'\]; known tables: "
        r"embeddings.0, embeddings.1, .*embeddings.25",
    ):
        TableLayout(2, table_storage={"embeddings.99": "int8"}).plan(tiny_tables)


def test_more_shards_than_slices_says_which_are_empty_and_suggests_row_wise(tiny_tables):
    with pytest.raises(ValueError) as info:
        TableLayout(28).plan(tiny_tables)
    assert "leaves shards [26, 27] empty" in str(info.value) and "row_wise_min_bytes" in str(info.value)
    assert len(TableLayout(28, row_wise_min_bytes=SPLIT_TINY).plan(tiny_tables)) == 28


def test_slice_must_be_a_non_empty_range_of_the_table():
    with pytest.raises(ValueError, match="non-empty range"):
        TableSlice("t", 5, 5, 10, 4)
    with pytest.raises(ValueError, match="non-empty range"):
        TableSlice("t", 5, 11, 10, 4)


# --- RowStore ---


def rows_of(seed: int, rows: int = 40, dim: int = 8) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)) * 0.3


def store_of(weight: torch.Tensor, dtype: str) -> RowStore:
    rows, dim = weight.shape
    return RowStore(TableSlice("t", 0, rows, rows, dim), weight, dtype)


def test_float32_store_is_exact_and_owns_its_copy():
    weight = rows_of(0)
    store = store_of(weight, "float32")
    expected = weight.clone()
    weight.zero_()
    ids = torch.tensor([3, 0, 3, 39])
    assert torch.equal(store.lookup(ids), expected[ids])
    assert store.nbytes == storage_bytes(40, 8, "float32") == 40 * 8 * 4


def test_float16_store_is_the_float16_rounding():
    weight = rows_of(1)
    store = store_of(weight, "float16")
    ids = torch.tensor([7, 7, 1], dtype=torch.int32)
    rows = store.lookup(ids)
    assert rows.dtype == torch.float32
    assert torch.equal(rows, weight[ids.long()].half().float())
    assert store.nbytes == storage_bytes(40, 8, "float16") == 40 * 8 * 2


def test_int8_store_is_within_half_a_scale_of_every_value():
    weight = rows_of(2, rows=200, dim=16)
    weight[5] = 100.05 + torch.linspace(0, 1e-3, 16)  # float16 rounds 100.05 up to 100.0625: the bias must not
    weight[6] = -7.0 + torch.linspace(0, 20, 16)
    store = store_of(weight, "int8")
    ids = torch.arange(200)
    error = (store.lookup(ids) - weight).abs()
    half_scale = store.scale.float() / 2
    assert bool((error <= half_scale * (1 + 1e-6) + 1e-7).all()), float((error - half_scale).max())
    assert store.values.dtype == torch.uint8 and store.scale.dtype == store.bias.dtype == torch.float16
    assert int(store.values.min()) == 0 and int(store.values.max()) == 255
    assert store.nbytes == storage_bytes(200, 16, "int8") == 200 * (16 + 4)


def test_int8_store_reads_constant_rows_back_exactly():
    weight = rows_of(3, rows=5, dim=8)
    weight[0] = 0.0
    weight[1] = -1.25
    weight[3] = 0.5
    weight[4] = 0.1  # float16 cannot hold it: comes back as its float16 rounding
    store = store_of(weight, "int8")
    rows = store.lookup(torch.tensor([0, 1, 3, 0, 4]))
    expected = torch.stack([weight[0], weight[1], weight[3], weight[0], weight[4].half().float()])
    assert torch.equal(rows, expected)


def test_int8_store_refuses_values_float16_cannot_scale():
    weight = rows_of(4)
    weight[2, 3] = float("inf")
    with pytest.raises(ValueError, match="int8 storage needs finite values"):
        store_of(weight, "int8")


def test_store_refuses_a_weight_of_another_shape_or_an_unknown_dtype():
    with pytest.raises(ValueError, match=r"weight is \[40, 8\], the slice is \[40, 4\]"):
        RowStore(TableSlice("t", 0, 40, 40, 4), rows_of(0), "float32")
    with pytest.raises(ValueError, match="unknown storage dtype 'int4'"):
        store_of(rows_of(0), "int4")


# --- build_embedding_shard ---


def assert_rows_equal_the_model(shard, model: DLRM) -> None:
    for piece, store in zip(shard.slices, shard.stores, strict=True):
        expected = model.get_submodule(piece.table).weight.detach()[piece.row_start : piece.row_stop]
        assert torch.equal(store.lookup(torch.arange(piece.rows)), expected), piece.name


@pytest.mark.parametrize("weighted", [False, True], ids=["seed", "shipped-weights"])
def test_shards_hold_the_full_models_rows_and_together_every_row(weighted, full, trained):
    model, weights = (trained, preset_weights("tiny")) if weighted else (full, None)
    layout = TableLayout(3, row_wise_min_bytes=SPLIT_TINY)
    shards = [build_embedding_shard(PresetSource("tiny", SEED, weights), index, layout) for index in range(3)]
    held = {}
    for index, shard in enumerate(shards):
        assert shard.index == index
        assert shard.input_names == shard.output_names == tuple(piece.name for piece in shard.slices)
        assert_rows_equal_the_model(shard, model)
        held.update({piece.name: piece for piece in shard.slices})
    rows = {table: sum(p.rows for p in held.values() if p.table == table) for table in embedding_tables(model)}
    assert rows == {table: rows for table, (rows, _) in embedding_tables(model).items()}


def test_shard_materializes_only_its_own_tables(monkeypatch):
    layout = TableLayout(4)
    expected = {piece.table for piece in layout.plan(embedding_tables(DLRM(TINY, device="meta")))[2]}
    drawn = []
    generator = disagg.model._generator
    monkeypatch.setattr(disagg.model, "_generator", lambda seed, name: drawn.append(name) or generator(seed, name))
    shard = build_embedding_shard(PresetSource("tiny", SEED), 2, layout)
    assert sorted(drawn) == sorted(expected)
    assert {piece.table for piece in shard.slices} == expected


def test_shard_reads_only_its_own_tables_from_a_weights_file(monkeypatch):
    layout = TableLayout(4, row_wise_min_bytes=SPLIT_TINY)
    read = []
    tensor = disagg.model._TrainedWeights.tensor
    monkeypatch.setattr(disagg.model._TrainedWeights, "tensor", lambda self, key: read.append(key) or tensor(self, key))
    shard = build_embedding_shard(PresetSource("tiny", SEED, preset_weights("tiny")), 1, layout)
    assert sorted(read) == sorted({f"{piece.table}.weight" for piece in shard.slices})


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_shard_stores_its_rows_in_the_storage_dtype(dtype, full):
    layout = TableLayout(
        2, row_wise_min_bytes=SPLIT_TINY, storage_dtype=dtype, table_storage={"embeddings.0": "float32"}
    )
    shard = build_embedding_shard(PresetSource("tiny", SEED), 0, layout)
    for piece, store in zip(shard.slices, shard.stores, strict=True):
        rows = full.get_submodule(piece.table).weight.detach()[piece.row_start : piece.row_stop]
        assert store.dtype == layout.storage_of(piece.table)
        reference = RowStore(piece, rows, store.dtype).lookup(torch.arange(piece.rows))
        assert torch.equal(store.lookup(torch.arange(piece.rows)), reference), piece.name
    assert shard.parameter_bytes == sum(storage_bytes(p.rows, p.dim, layout.storage_of(p.table)) for p in shard.slices)
    assert any(store.dtype == "float32" for store in shard.stores)


@pytest.mark.parametrize("index", [-1, 2])
def test_shard_index_out_of_range_is_a_value_error(index):
    with pytest.raises(ValueError, match=rf"shard index must be in \[0, 2\), got {index}"):
        build_embedding_shard(PresetSource("tiny", SEED), index, TableLayout(2))


# --- TableShard.module ---


@pytest.fixture(scope="module")
def split_shard():
    return build_embedding_shard(PresetSource("tiny", SEED), 1, TableLayout(2, row_wise_min_bytes=SPLIT_TINY))


def shard_inputs(shard, count: int = 3) -> dict[str, torch.Tensor]:
    return {piece.name: torch.arange(count, dtype=torch.int64) % piece.rows for piece in shard.slices}


def test_module_returns_float32_rows_per_slice_for_local_ids(split_shard, full):
    piece = next(piece for piece in split_shard.slices if not piece.whole)
    assert piece.row_start > 0
    inputs = shard_inputs(split_shard)
    inputs[piece.name] = torch.tensor([piece.rows - 1, 0, 0], dtype=torch.int32)
    outputs = split_shard.module(**inputs)
    assert tuple(outputs) == split_shard.output_names
    weight = full.get_submodule(piece.table).weight.detach()
    assert torch.equal(outputs[piece.name], weight[[piece.row_stop - 1, piece.row_start, piece.row_start]])
    empty = split_shard.module(**{**inputs, piece.name: torch.empty(0, dtype=torch.int64)})
    assert empty[piece.name].shape == (0, TINY.embedding_dim) and empty[piece.name].dtype == torch.float32


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (lambda rows: torch.tensor([0, rows]), "id {rows} is out of range; valid ids are [0, {rows})"),
        (lambda rows: torch.tensor([-1, 0]), "id -1 is out of range; valid ids are [0, {rows})"),
        (lambda rows: torch.zeros(2, 1, dtype=torch.int64), "ids must be a 1-D int32 or int64 tensor, got int64[2, 1]"),
        (lambda rows: torch.zeros(2), "ids must be a 1-D int32 or int64 tensor, got float32[2]"),
    ],
)
def test_module_refuses_bad_ids_naming_the_input(split_shard, ids, message):
    piece = next(piece for piece in split_shard.slices if not piece.whole)
    inputs = {**shard_inputs(split_shard), piece.name: ids(piece.rows)}
    with pytest.raises(ValueError) as info:
        split_shard.module(**inputs)
    assert f"input {piece.name!r}: " + message.format(rows=piece.rows) in str(info.value)


@pytest.mark.parametrize("storage", ["float32", "float16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_writes_every_slices_rows_into_one_buffer_as_the_module_returns_them(storage, dtype):
    shard = build_embedding_shard(PresetSource("tiny", SEED), 1,
                                  TableLayout(2, row_wise_min_bytes=SPLIT_TINY, storage_dtype=storage))
    generator = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, piece.rows, (at % 4,), generator=generator, dtype=torch.int32)
           for at, piece in enumerate(shard.slices)]  # some slices asked for nothing
    rows = shard.module.gather(ids, dtype)
    expected = shard.module(**dict(zip(shard.input_names, ids, strict=True)))
    assert rows.dtype == dtype and rows.dim() == 1
    assert shard.module.widths == tuple(piece.dim for piece in shard.slices)
    assert torch.equal(rows, torch.cat([expected[name].to(dtype).reshape(-1) for name in shard.output_names]))


def test_gather_refuses_bad_ids_naming_the_input(split_shard):
    piece = split_shard.slices[-1]
    ids = [torch.zeros(1, dtype=torch.int64) for _ in split_shard.slices]
    ids[-1] = torch.tensor([piece.rows])
    with pytest.raises(ValueError, match=re.escape(f"input {piece.name!r}: id {piece.rows} is out of range")):
        split_shard.module.gather(ids, torch.float32)
    with pytest.raises(ValueError, match="ids of 1 slices given"):
        split_shard.module.gather(ids[:1], torch.float32)


def test_a_store_error_with_ids_in_range_is_not_reported_as_a_bad_id(monkeypatch):
    shard = build_embedding_shard(PresetSource("tiny", SEED), 0, TableLayout(2))  # its own: the store is patched
    store = shard.stores[0]

    def broken(ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("store failure")

    monkeypatch.setattr(store, "lookup", broken)
    with pytest.raises(RuntimeError, match="store failure"):
        shard.module(**shard_inputs(shard))


def test_module_refuses_missing_and_unknown_inputs(split_shard):
    inputs = shard_inputs(split_shard)
    first = split_shard.input_names[0]
    inputs["embeddings.99"] = inputs.pop(first)
    with pytest.raises(ValueError, match=re.escape(f"missing [{first!r}], unknown ['embeddings.99']")):
        split_shard.module(**inputs)


# --- versions ---


def test_version_is_a_function_of_the_config_alone():
    layout = TableLayout(2, row_wise_min_bytes=SPLIT_TINY, storage_dtype="float16")
    shard = build_embedding_shard(PresetSource("tiny", SEED), 1, layout)
    assert (
        build_embedding_shard(
            PresetSource("tiny", SEED), 1, TableLayout(2, row_wise_min_bytes=SPLIT_TINY, storage_dtype="float16")
        ).version
        == shard.version
    )
    plan = layout.plan(embedding_tables(DLRM(TINY, device="meta")))
    assert shard_version(weights_source(SEED, None), plan[1], layout) == shard.version


def test_another_seed_storage_dtype_slice_or_weights_file_gives_another_version():
    layout = TableLayout(2, row_wise_min_bytes=SPLIT_TINY)
    base = build_embedding_shard(PresetSource("tiny", SEED), 0, layout).version
    others = {
        "seed": build_embedding_shard(PresetSource("tiny", SEED + 1), 0, layout).version,
        "storage dtype": build_embedding_shard(
            PresetSource("tiny", SEED), 0, TableLayout(2, row_wise_min_bytes=SPLIT_TINY, storage_dtype="int8")
        ).version,
        "one table's storage": build_embedding_shard(
            PresetSource("tiny", SEED), 0,
            TableLayout(2, row_wise_min_bytes=SPLIT_TINY, table_storage={"embeddings.0": "int8"}),
        ).version,
        "index": build_embedding_shard(PresetSource("tiny", SEED), 1, layout).version,
        "slices": build_embedding_shard(
            PresetSource("tiny", SEED), 0, TableLayout(3, row_wise_min_bytes=SPLIT_TINY)
        ).version,
        "weights": build_embedding_shard(PresetSource("tiny", SEED, preset_weights("tiny")), 0, layout).version,
    }
    assert base not in others.values()
    assert len(set(others.values())) == len(others)


def test_weights_source_digests_the_file_contents(tmp_path):
    assert weights_source(3, None) == "seed:3"
    shipped = preset_weights("tiny")
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(shipped, copy)
    source = weights_source(3, shipped)
    assert source.startswith("file:") and weights_source(0, copy) == source
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(data)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert weights_source(3, copy) != source


# --- materialize_(only=...) ---


def test_materialize_only_builds_the_named_layers_with_the_full_models_values(full):
    model = DLRM(TINY, device="meta")
    materialize_(model, seed=SEED, only=["embeddings.3", "top_mlp.0"])
    built = {name for name, parameter in model.named_parameters() if not parameter.is_meta}
    assert built == {"embeddings.3.weight", "top_mlp.0.weight", "top_mlp.0.bias"}
    assert torch.equal(model.embeddings[3].weight, full.embeddings[3].weight)
    assert torch.equal(model.top_mlp[0].bias, full.top_mlp[0].bias)


def test_materialize_only_refuses_names_of_no_layer():
    with pytest.raises(ValueError, match=r"only: \['embeddings.99', 'top_mlp'\] name no Linear or EmbeddingBag"):
        materialize_(DLRM(TINY, device="meta"), seed=SEED, only=["embeddings.1", "embeddings.99", "top_mlp"])
