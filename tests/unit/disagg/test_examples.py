"""The shipped user models (disagg/examples/, deploy/examples/): their Serve configs validate, ``check_model`` passes,
and served disaggregated (shards and dense part built alone, seeded or from a weights file) they equal the model."""

import pytest
import torch
from safetensors.torch import save_file

import disagg.examples
from disagg.model_check import check_model, output_tensors
from disagg.model_source import FactorySource, PresetSource, model_source
from disagg.signature import dlrm_signature
from disagg.spec import preset_weights
from disagg.synthetic import SyntheticRequests
from disagg.tables import TableLayout, build_embedding_shard, embedding_tables
from tests.helpers import REPO
from tests.helpers.user_models import (
    EXAMPLE_CONFIGS,
    EXAMPLES,
    build_shards,
    draw_inputs,
    example_config,
    example_serve_config,
    serve_disaggregated,
    serve_whole,
    weights_reads,
)

BATCH = 16


def test_every_example_has_a_serve_config_of_one_disaggregated_app_on_two_shards():
    modules = {path.stem for path in (REPO / "disagg" / "examples").glob("*.py")} - {"__init__"}
    assert modules == {path.stem for path in EXAMPLE_CONFIGS.glob("*.yaml")} == set(EXAMPLES)
    assert disagg.examples.__doc__
    for name in EXAMPLES:
        (app,) = example_serve_config(name)["applications"]
        assert (app["import_path"], app["route_prefix"]) == ("disagg.app:build_app", "/v2")
        config = example_config(name)
        assert config.model.factory == f"disagg.examples.{name}:build"
        assert (config.model_name, config.serving, config.embedding.num_shards) == (name, "disaggregated", 2)
        assert sum(entry["ray_actor_options"]["num_cpus"] for entry in app["deployments"]) <= 1


#: Each example's tables: (how many, the widths of their rows).
TABLES = {"dlrm": (26, {16}), "dcn_v2": (3, {8}), "deepfm": (8, {8, 1}), "two_tower": (3, {16})}


@pytest.mark.parametrize("name", EXAMPLES)
def test_check_model_passes_and_reports_every_table(name):
    config = example_config(name)
    report = check_model(config)
    assert report.label == config.model.factory
    assert (len(report.tables), {dim for _, dim in report.tables.values()}) == TABLES[name]
    assert report.notes == ()  # every lookup is pooled before the cut


@pytest.mark.parametrize("name", EXAMPLES)
def test_seeded_example_served_disaggregated_equals_the_model(name):
    config = example_config(name, seed=3)
    source = model_source(config.model)
    inputs = draw_inputs(source.signature, check_model(config).id_ranges, BATCH, seed=1)
    expected = serve_whole(source, inputs)
    assert len(expected[0].unique()) > BATCH // 2  # outputs that tell rows apart: no saturated sigmoid
    got = serve_disaggregated(source, build_shards(source, TableLayout(2)), inputs)
    for output, value, reference in zip(source.signature.outputs, got, expected, strict=True):
        assert torch.equal(value, reference), output.name


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_from_a_weights_file_reads_each_part_alone_and_equals_the_model_of_those_values(
    name, tmp_path, monkeypatch
):
    model = model_source(example_config(name).model).build()
    generator = torch.Generator().manual_seed(7)
    values = {key: value + 0.05 * torch.randn(value.shape, generator=generator) if value.is_floating_point() else value
              for key, value in model.state_dict().items()}
    path = tmp_path / "state.safetensors"
    save_file(values, str(path))
    config = example_config(name, weights=str(path))
    source = model_source(config.model)
    layout = TableLayout(2)
    shards = []
    for index in range(layout.num_shards):
        with weights_reads(monkeypatch) as read:
            shards.append(build_embedding_shard(source, index, layout))
        assert sorted(read) == sorted(f"{piece.table}.weight" for piece in shards[-1].slices)
    inputs = draw_inputs(source.signature, check_model(config).id_ranges, BATCH, seed=2)
    with weights_reads(monkeypatch) as read:
        got = serve_disaggregated(source, shards, inputs)
    assert set(read) == values.keys() - {f"{table}.weight" for table in embedding_tables(model)}  # the dense part's
    seeded = serve_whole(model_source(example_config(name).model), inputs)
    model.load_state_dict(values)
    with torch.no_grad():
        expected = output_tensors(model(**inputs), source.signature)
    assert not torch.equal(expected[0], seeded[0])  # the file's values are served, not the seed's
    for output, value, whole, reference in zip(source.signature.outputs, got, serve_whole(source, inputs), expected,
                                               strict=True):
        assert torch.equal(value, reference), output.name
        assert torch.equal(whole, reference), output.name


def test_the_dlrm_example_with_the_shipped_weights_serves_what_the_tiny_preset_serves():
    weights = preset_weights("tiny")
    signature = dlrm_signature(13, 26)
    example = FactorySource("disagg.examples.dlrm:build", 0, weights, signature)
    preset = PresetSource("tiny", weights=weights)
    dense, sparse = SyntheticRequests(preset.spec, seed=3, max_hotness=3).batch(BATCH)
    inputs = {"dense": dense, "sparse": sparse}
    expected = serve_whole(preset, inputs)
    assert not torch.equal(expected[0], serve_whole(PresetSource("tiny"), inputs)[0])  # trained, not seeded
    assert torch.equal(serve_whole(example, inputs)[0], expected[0])
    shards = build_shards(example, TableLayout(2))
    assert torch.equal(serve_disaggregated(example, shards, inputs)[0], expected[0])
