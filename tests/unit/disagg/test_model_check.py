"""check_model on user models: every problem one ModelError naming the config key (and, for the graph, the node and
source line); a sequence embedding crossing the cut unpooled is a note, not an error."""

import asyncio
import re

import pytest
import torch
from safetensors.torch import save_file

from disagg.config import DLRMAppConfig
from disagg.deployments.monolithic import MonolithicDLRM
from disagg.model_check import check_model
from disagg.model_source import ModelError, model_source
from tests.helpers.user_models import example_config, user_config, write_factory

TWO_TOWER = "disagg.examples.two_tower:build"
TWO_TOWER_INPUTS = [
    {"name": "user_id", "datatype": "INT64", "shape": [-1]},
    {"name": "history", "datatype": "INT64", "shape": [-1, -1], "pad_value": 0},
    {"name": "item_id", "datatype": "INT64", "shape": [-1]},
]
TWO_TOWER_OUTPUTS = [{"name": "score", "datatype": "FP32", "shape": [-1, 1]},
                     {"name": "user_embedding", "datatype": "FP32", "shape": [-1, 16]}]

#: A user model in a file: a mean bag of ``ids`` [B, L] and a linear head -> [B, 1].
BAG_MODEL = """
    import torch
    from torch import nn

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.EmbeddingBag(40, 4, mode="mean")
            self.head = nn.Linear(4, 1)

        def forward(self, ids):
            return self.head(self.table(ids))

    def build():
        return Bag()
"""
IDS = [{"name": "ids", "datatype": "INT64", "shape": [-1, -1]}]
ONE_OUTPUT = [{"name": "score", "datatype": "FP32", "shape": [-1, 1]}]


def check_fails(config, key: str, message: str) -> ModelError:
    """``check_model(config)`` raises a ModelError at ``key`` whose message matches ``message``."""
    with pytest.raises(ModelError, match=message) as raised:
        check_model(config)
    assert raised.value.key == key
    return raised.value


def test_a_factory_in_a_file_is_checked_and_builds(tmp_path):
    config = user_config(write_factory(tmp_path, BAG_MODEL), IDS, ONE_OUTPUT)
    report = check_model(config)
    assert report.tables == {"table": (40, 4)}
    assert report.id_ranges["ids"].high.tolist() == [[40]]
    model = model_source(config.model).build()
    assert model(ids=torch.tensor([[1, 2, 3]])).shape == (1, 1)


@pytest.mark.parametrize(("factory", "message"), [
    ("no_such_package.models:build", r"cannot import 'no_such_package\.models': ModuleNotFoundError"),
    ("disagg.examples.two_tower:missing", r"'disagg\.examples\.two_tower' has no attribute 'missing'"),
    ("disagg.examples.two_tower:USERS", r"disagg\.examples\.two_tower:USERS is not callable: it is of type int"),
    ("/nowhere/model.py:build", r"file not found: /nowhere/model\.py"),
])
def test_a_factory_that_cannot_be_found_is_named(factory, message):
    check_fails(user_config(factory, IDS), "model.factory", message)


@pytest.mark.parametrize(("source", "message"), [
    ("def build():\n    return {'table': 1}\n", r"model\.py:build returned dict, not a torch nn\.Module"),
    ("def build():\n    raise RuntimeError('no GPU here')\n", r"model\.py:build\(\) raised RuntimeError: no GPU here"),
    ("raise ImportError('missing dependency')\n", r"cannot import '.*model\.py': ImportError: missing dependency"),
])
def test_a_factory_that_fails_says_how(tmp_path, source, message):
    check_fails(user_config(write_factory(tmp_path, source), IDS), "model.factory", message)


def two_tower_weights(tmp_path, change) -> str:
    """A weights file of the two-tower model's state dict after ``change(state)``."""
    state = model_source(example_config("two_tower").model).build().state_dict()
    change(state)
    path = tmp_path / "state.safetensors"
    save_file(state, str(path))
    return str(path)


@pytest.mark.parametrize(("change", "message"), [
    (lambda state: state.pop("item_tower.2.bias"), r"lacks 1 tensor\(s\) of the model, first 'item_tower\.2\.bias'"),
    (lambda state: state.update(extra=torch.zeros(2)), r"holds 1 tensor\(s\) the model has not, first 'extra'"),
    (lambda state: state.update({"users.weight": torch.zeros(999, 16)}),
     r"'users\.weight' is \[999, 16\] in .*, the model's is \[1000, 16\]"),
])
def test_weights_that_do_not_fit_the_model_are_named(tmp_path, change, message):
    weights = two_tower_weights(tmp_path, change)
    check_fails(example_config("two_tower", weights=weights), "model.weights", message)


def test_weights_that_fit_pass(tmp_path):
    weights = two_tower_weights(tmp_path, lambda state: None)
    assert check_model(example_config("two_tower", weights=weights)).tables["users"] == (1000, 16)


@pytest.mark.parametrize(("inputs", "outputs", "key", "message"), [
    ([*TWO_TOWER_INPUTS[:2], {**TWO_TOWER_INPUTS[2], "argument": "candidate"}], TWO_TOWER_OUTPUTS, "model.inputs[2]",
     r"TwoTower\.forward has no argument 'candidate'; its arguments: user_id, history, item_id"),
    (TWO_TOWER_INPUTS[:2], TWO_TOWER_OUTPUTS, "model.inputs", r"TwoTower\.forward needs argument 'item_id'"),
    (TWO_TOWER_INPUTS, TWO_TOWER_OUTPUTS[:1], "model.outputs",
     r"forward returns 2 tensor\(s\), the signature has 1 output\(s\): \['score'\]"),
    (TWO_TOWER_INPUTS, [TWO_TOWER_OUTPUTS[0], {**TWO_TOWER_OUTPUTS[1], "shape": [-1, 8]}], "model.outputs[1]",
     r"'user_embedding' is declared \[-1, 8\], forward returns \[2, 16\] for a batch of 2"),
    ([*TWO_TOWER_INPUTS[:2], {**TWO_TOWER_INPUTS[2], "shape": [-1, 3]}], TWO_TOWER_OUTPUTS, "model.inputs",
     r"TwoTower\.forward fails on inputs of the signature's shapes \(.*item_id \[2, 3\]\)"),
])
def test_a_signature_that_does_not_fit_forward_is_named(inputs, outputs, key, message):
    check_fails(user_config(TWO_TOWER, inputs, outputs), key, message)


BRANCHY_MODEL = """
    import torch
    from torch import nn

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.EmbeddingBag(40, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, ids):
            pooled = self.table(ids)
            if pooled.sum() > 0:
                pooled = -pooled
            return self.head(pooled)

    def build():
        return Branchy()
"""


def test_data_dependent_control_flow_names_the_node_and_the_source_line(tmp_path):
    factory = write_factory(tmp_path, BRANCHY_MODEL)
    line = next(number for number, text in enumerate(BRANCHY_MODEL.splitlines(), start=1) if "if pooled" in text)
    error = check_fails(user_config(factory, IDS, ONE_OUTPUT), "model", "cannot trace Branchy.forward with torch.fx")
    assert f"at node 'gt', model.py:{line} (if pooled.sum() > 0:)" in str(error)
    assert "TraceError" in str(error)


def test_a_model_without_embeddings_is_named(tmp_path):
    source = "from torch import nn\n\ndef build():\n    return nn.Linear(4, 1)\n"
    inputs = [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    check_fails(user_config(write_factory(tmp_path, source), inputs, ONE_OUTPUT), "model",
                re.escape("Linear has no embedding operator"))


def test_table_storage_naming_no_table_of_the_model_is_named():
    args = example_config("two_tower").model_dump()
    args["embedding"]["table_storage"] = {"user": "int8"}
    check_fails(DLRMAppConfig.model_validate(args), "embedding.table_storage",
                r"unknown table 'user'; the model's tables: users, history, items")


SEQUENCE_MODEL = """
    from torch import nn

    class Sequence(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = nn.Embedding(100, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, history):
            return self.head(self.items(history)).sum(dim=1)

    def build():
        return Sequence()
"""


def test_a_sequence_embedding_crossing_the_cut_unpooled_is_a_note_with_its_size(tmp_path):
    inputs = [{"name": "history", "datatype": "INT64", "shape": [-1, -1]}]
    report = check_model(user_config(write_factory(tmp_path, SEQUENCE_MODEL), inputs, ONE_OUTPUT))
    (note,) = report.notes
    assert "embedding output 'items' crosses the cut unpooled, [batch, 3, 8] at 3 ids per row (24 values a row" in note
    assert "pool it" in note
    assert report.id_ranges["history"].high.tolist() == [[100]]


def test_an_untraceable_model_is_served_monolithically_as_it_is(tmp_path):
    config = user_config(write_factory(tmp_path, BRANCHY_MODEL), IDS, ONE_OUTPUT).model_copy(
        update={"serving": "monolithic"})
    report = check_model(config)
    assert report.id_ranges == {}
    assert len(report.notes) == 1 and report.notes[0].startswith("served as is, without stacked tables or id checks")
    wrapper = MonolithicDLRM.func_or_class  # Serve's ASGI ingress wrapper: its __init__ is a coroutine
    replica = wrapper.__new__(wrapper)
    asyncio.run(replica.__init__(config))
    ids = torch.randint(0, 40, (3, 5))
    with torch.inference_mode():
        expected = replica.model(ids)
        served = replica._forward({"ids": ids})
    assert torch.equal(served, expected) and replica.id_ranges == {}
