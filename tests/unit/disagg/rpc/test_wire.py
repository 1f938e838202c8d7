"""Tensor wire format of the embedding service."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from disagg.rpc import wire
from disagg.rpc._proto import embedding_pb2 as pb


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()))
def test_round_trip_keeps_values_dtype_and_shape(dtype):
    tensor = (torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    message = wire.encode("x", tensor)
    assert message.name == "x" and list(message.shape) == [3, 5]
    assert len(message.data) == 15 * dtype.itemsize  # raw bytes, nothing else
    decoded = wire.decode(message)
    assert decoded.dtype == dtype
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize("tensor", [torch.arange(6.0).reshape(2, 3).t(), torch.tensor(7), torch.empty(0, 4)])
def test_round_trip_of_non_contiguous_scalar_and_empty(tensor):
    raw = wire.encode("t", tensor).SerializeToString()
    decoded = wire.decode(pb.Tensor.FromString(raw))
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_data_is_little_endian_row_major():
    message = wire.encode("x", torch.tensor([[1, 2]], dtype=torch.int32))
    assert message.data == b"\x01\x00\x00\x00\x02\x00\x00\x00"


def test_decode_views_the_data_bytes_without_copying():
    data = torch.arange(4, dtype=torch.int64).numpy().tobytes()
    message = SimpleNamespace(name="x", dtype="int64", shape=[2, 2], data=data)
    decoded = wire.decode(message)
    assert torch.equal(decoded, torch.arange(4).reshape(2, 2))
    assert decoded.data_ptr() == np.frombuffer(data, dtype=np.uint8).ctypes.data


def test_all_round_trip_by_name():
    tensors = {"a": torch.ones(2), "b": torch.arange(3)}
    decoded = wire.decode_all(wire.encode_all(tensors))
    assert decoded.keys() == tensors.keys()
    assert all(torch.equal(decoded[name], tensors[name]) for name in tensors)


def _message(**fields):
    base = {"name": "ids", "dtype": "int64", "shape": [2], "data": bytes(16)}
    return pb.Tensor(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"dtype": "float64"}, "tensor 'ids': unknown dtype 'float64'; supported: float32"),
        ({"dtype": ""}, "unknown dtype ''"),
        ({"shape": [-2, -1]}, "negative dimension in shape [-2, -1]"),
        ({"shape": [1] * 9, "data": bytes(8)}, "9 dimensions, at most 8 allowed"),
        ({"data": bytes(15)}, "data holds 15 bytes, but shape [2] of int64 needs 16"),
        ({"shape": [2, 1 << 40]}, "elements, at most"),
    ],
)
def test_decode_refuses_malformed_tensors(fields, error):
    with pytest.raises(ValueError) as info:
        wire.decode(_message(**fields))
    assert str(info.value).startswith("tensor 'ids': ")
    assert error in str(info.value)


def test_decode_element_limit_is_configurable():
    assert wire.decode(_message(), max_elements=2).shape == (2,)
    with pytest.raises(ValueError, match="2 elements, at most 1 allowed"):
        wire.decode(_message(), max_elements=1)


def test_decode_all_refuses_repeated_and_empty_names():
    with pytest.raises(ValueError, match="'ids' appears more than once"):
        wire.decode_all([_message(), _message()])
    with pytest.raises(ValueError, match="empty name"):
        wire.decode_all([_message(name="")])


@pytest.mark.parametrize(
    ("tensor", "error"),
    [
        (torch.zeros(2, dtype=torch.float64), "dtype torch.float64 is not supported"),
        (torch.zeros(2, dtype=torch.bool), "dtype torch.bool is not supported"),
        (torch.zeros([1] * 9), "9 dimensions, at most 8 allowed"),
    ],
)
def test_encode_refuses_what_the_wire_cannot_carry(tensor, error):
    with pytest.raises(ValueError, match=error):
        wire.encode("x", tensor)


def test_encode_element_limit():
    with pytest.raises(ValueError, match="tensor 'x': 10 elements, at most 9 allowed"):
        wire.encode("x", torch.zeros(10), max_elements=9)
