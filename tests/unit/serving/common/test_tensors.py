"""Tensors through Ray's serializer as numpy arrays (``serving.common.tensors``): equal on arrival in dtype, shape
and values, writable memory of their own, and torch's own pickling for what numpy cannot carry."""

import pickle

import numpy as np
import pytest
import torch

from serving.common import tensors


def _round_trip(tensor: torch.Tensor) -> torch.Tensor:
    """What the receiving process rebuilds: the serialized state pickled across, then deserialized."""
    return tensors._deserialize(pickle.loads(pickle.dumps(tensors._serialize(tensor), protocol=5)))


@pytest.mark.parametrize("tensor", [
    torch.randn(32, 13), torch.randint(-5, 5, (4, 26, 1)), torch.randn(3, 2).to(torch.bfloat16),
    torch.randn(6, 4)[:, ::2], torch.zeros(0, 3, dtype=torch.int32), torch.tensor(True),
], ids=["float32", "int64", "bfloat16", "strided", "empty", "bool"])
def test_plain_tensors_travel_as_numpy_and_arrive_equal(tensor):
    kind, state = tensors._serialize(tensor)
    assert kind == str(tensor.dtype).removeprefix("torch.") and isinstance(state, np.ndarray)
    arrived = _round_trip(tensor)
    assert arrived.dtype == tensor.dtype and arrived.shape == tensor.shape and torch.equal(arrived, tensor)


def test_a_read_only_buffer_arrives_as_writable_memory_of_its_own():
    array = np.arange(4, dtype=np.float32)
    array.setflags(write=False)
    arrived = tensors._deserialize(("float32", array))
    arrived += 1  # would fault on a read-only object-store buffer
    assert arrived.tolist() == [1, 2, 3, 4] and array.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("tensor", [torch.randn(2, requires_grad=True), torch.randn(2, dtype=torch.cfloat).conj(),
                                    torch.randn(4, 4).to_sparse()], ids=["autograd", "conjugate", "sparse"])
def test_what_numpy_cannot_carry_keeps_torch_pickling(tensor):
    kind, _ = tensors._serialize(tensor)
    assert kind == "pickle"
    arrived = _round_trip(tensor)
    assert arrived.requires_grad == tensor.requires_grad and arrived.layout == tensor.layout
    assert torch.equal(arrived.detach().to_dense().resolve_conj(), tensor.detach().to_dense().resolve_conj())
