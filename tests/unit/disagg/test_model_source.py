"""ModelSource of a user model: seeded builds, the skeleton on meta, parts read alone from a weights file (parameters,
persistent buffers, tied parameters), and every failure a ModelError naming the key."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from disagg.model_check import check_weights
from disagg.model_source import FactorySource, ModelError, load_parameters, parameters_on_meta
from disagg.signature import InputSignature, ModelSignature
from tests.helpers.user_models import weights_reads, write_factory

#: A user model with a table, a batch norm (persistent running statistics), a non-persistent buffer and a head
#: tied to the table.
NORMED_MODEL = """
    import torch
    from torch import nn

    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(20, 4)
            self.norm = nn.BatchNorm1d(4)
            self.head = nn.Linear(4, 20, bias=False)
            self.head.weight = self.table.weight
            self.register_buffer("scale", torch.full((1,), 2.0), persistent=False)

        def forward(self, ids):
            return self.head(self.norm(self.table(ids)) * self.scale)

    def build():
        return Normed()
"""
SIGNATURE = ModelSignature(inputs=[InputSignature(name="ids", datatype="INT64", shape=[-1])])


@pytest.fixture
def factory(tmp_path) -> str:
    return write_factory(tmp_path, NORMED_MODEL)


def trained_state(factory: str) -> dict[str, torch.Tensor]:
    """State dict values no seed gives: the seed-0 model's, shifted, with running statistics of their own."""
    model = FactorySource(factory, 0, None, SIGNATURE).build()
    model.norm.running_mean.fill_(0.5)
    model.norm.running_var.fill_(3.0)
    model.norm.num_batches_tracked.fill_(9)
    state = model.state_dict()
    return {key: value + 1 if value.is_floating_point() else value for key, value in state.items()}


def weights_file(tmp_path, state: dict[str, torch.Tensor]) -> str:
    """``state`` saved as safetensors (tied tensors once: the file of ``save_model``)."""
    path = tmp_path / "state.safetensors"
    save_file({key: value for key, value in state.items() if key != "head.weight"}, str(path))
    return str(path)


def test_a_seeded_factory_builds_the_same_model_per_seed_and_leaves_the_global_rng_alone(factory):
    rng = torch.get_rng_state()
    first, again = (FactorySource(factory, 4, None, SIGNATURE).build().state_dict() for _ in range(2))
    other = FactorySource(factory, 5, None, SIGNATURE).build().state_dict()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["table.weight"], other["table.weight"])
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_skeleton_of_a_weights_file_model_has_parameters_on_meta_and_real_buffers(factory, tmp_path):
    source = FactorySource(factory, 0, weights_file(tmp_path, trained_state(factory)), SIGNATURE)
    skeleton = source.skeleton()
    assert all(parameter.is_meta for parameter in skeleton.parameters())
    assert not any(buffer.is_meta for buffer in skeleton.buffers())
    assert skeleton.head.weight is skeleton.table.weight
    assert not skeleton.training


def test_a_built_model_holds_the_files_parameters_and_running_statistics_ties_kept(factory, tmp_path):
    state = trained_state(factory)
    model = FactorySource(factory, 0, weights_file(tmp_path, state), SIGNATURE).build()
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert model.head.weight is model.table.weight
    assert float(model.scale) == 2.0  # not in the file: the model's own


def test_check_weights_takes_a_tied_tensor_under_either_of_its_names(factory, tmp_path):
    state = trained_state(factory)
    skeleton = FactorySource(factory, 0, None, SIGNATURE).skeleton()
    check_weights(skeleton, weights_file(tmp_path, state))  # holds table.weight, not its tie head.weight
    save_file({key: value for key, value in state.items() if key != "table.weight"}, str(tmp_path / "head.safetensors"))
    check_weights(skeleton, tmp_path / "head.safetensors")
    model = load_parameters(FactorySource(factory, 0, tmp_path / "head.safetensors", SIGNATURE).skeleton(),
                            tmp_path / "head.safetensors")
    assert torch.equal(model.table.weight, state["table.weight"]) and model.head.weight is model.table.weight
    save_file({key: value for key, value in state.items() if "weight" not in key or "norm" in key},
              str(tmp_path / "neither.safetensors"))
    with pytest.raises(ModelError, match=r"lacks 1 tensor\(s\) of the model, first 'table\.weight'"):
        check_weights(skeleton, tmp_path / "neither.safetensors")


def test_materialize_only_reads_the_named_submodules(factory, tmp_path, monkeypatch):
    source = FactorySource(factory, 0, weights_file(tmp_path, trained_state(factory)), SIGNATURE)
    skeleton = source.skeleton()
    with weights_reads(monkeypatch) as read:
        source.materialize(skeleton, only=["norm"])
    assert sorted(read) == ["norm.bias", "norm.num_batches_tracked", "norm.running_mean", "norm.running_var",
                            "norm.weight"]
    assert skeleton.table.weight.is_meta and not skeleton.norm.weight.is_meta


def test_a_parameter_the_factory_made_on_the_cpu_is_read_from_the_file_too(tmp_path):
    model = nn.Linear(3, 2)
    state = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
    save_file(state, str(tmp_path / "linear.safetensors"))
    load_parameters(model, tmp_path / "linear.safetensors")
    assert torch.equal(model.weight, state["weight"]) and torch.equal(model.bias, state["bias"])


@pytest.mark.parametrize(("state", "message"), [
    ({"weight": torch.ones(2, 3)}, r"holds no tensor 'bias'"),
    ({"weight": torch.ones(3, 2), "bias": torch.zeros(2)}, r"'weight' is \(3, 2\) in .*, the model's is \(2, 3\)"),
])
def test_a_tensor_the_file_lacks_or_holds_in_another_shape_is_named(tmp_path, state, message):
    path = tmp_path / "linear.safetensors"
    save_file(state, str(path))
    with parameters_on_meta():
        model = nn.Linear(3, 2)
    with pytest.raises(ModelError, match=message) as raised:
        load_parameters(model, path)
    assert raised.value.key == "model.weights"


def test_a_weights_file_that_is_missing_or_not_safetensors_is_named(tmp_path):
    with pytest.raises(ModelError, match=r"model\.weights: file not found: .*absent\.safetensors"):
        load_parameters(nn.Linear(3, 2), tmp_path / "absent.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ModelError, match=r"model\.weights: .*junk\.safetensors: not a valid safetensors file"):
        load_parameters(nn.Linear(3, 2), tmp_path / "junk.safetensors")


def test_parameters_on_meta_puts_only_parameters_on_meta_and_is_undone_after_an_error():
    with pytest.raises(RuntimeError, match="factory failed"), parameters_on_meta():
        norm = nn.BatchNorm1d(4)
        raise RuntimeError("factory failed")
    assert norm.weight.is_meta and not norm.running_mean.is_meta
    assert not nn.Linear(2, 2).weight.is_meta


def test_version_source_tells_factories_seeds_and_files_apart(factory, tmp_path):
    weights = weights_file(tmp_path, trained_state(factory))
    versions = {FactorySource(factory, 0, None, SIGNATURE).version_source,
                FactorySource(factory, 1, None, SIGNATURE).version_source,
                FactorySource(factory, 0, weights, SIGNATURE).version_source,
                FactorySource("disagg.examples.two_tower:build", 0, None, SIGNATURE).version_source}
    assert len(versions) == 4
    assert FactorySource(factory, 0, None, SIGNATURE).version_source in versions
