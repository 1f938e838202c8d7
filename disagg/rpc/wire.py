"""Torch tensors to and from the wire format of the embedding service: raw little-endian bytes, never lists.

Decoding does not copy: the tensor views the ``bytes`` object protobuf hands out for ``data``, memory that must
not be written, so clone a decoded tensor before changing it in place. Every field of an incoming tensor is
checked before its data is touched.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Mapping

import torch

from disagg.rpc._proto import embedding_pb2 as pb

#: The embedding service's full name in embedding.proto (gRPC method paths, health checks).
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EmbeddingShard"].full_name
#: Element types the wire accepts, by their names in ``Tensor.dtype``.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
#: Element types rows may be sent in (``LookupRequest.output_dtype``); "" means float32.
ROW_DTYPES: dict[str, torch.dtype] = {"": torch.float32, "float32": torch.float32, "float16": torch.float16,
                                      "bfloat16": torch.bfloat16}
ROW_DTYPE_NAMES = tuple(name for name in ROW_DTYPES if name)
MAX_DIMS = 8
#: Default cap on the elements of one tensor (512 MiB of float32), far above one request's pooled embeddings.
DEFAULT_MAX_ELEMENTS = 1 << 27

if sys.byteorder != "little":  # the wire is little-endian and tensors are sent as their native bytes
    raise ImportError("disagg.rpc.wire supports little-endian hosts only")


#: Decoded tensors view read-only bytes, as documented above; torch warns about that on every ``frombuffer``.
#: One process-wide filter for exactly that message (``catch_warnings`` per tensor costs more than the decode).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def dtype_name(tensor: torch.Tensor, name: str = "") -> str:
    """The wire name of ``tensor``'s dtype; ValueError (naming tensor ``name``) for one the wire does not carry."""
    if (found := _NAMES.get(tensor.dtype)) is None:
        raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} is not supported; supported: {', '.join(DTYPES)}")
    return found


def encode(name: str, tensor: torch.Tensor, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> pb.Tensor:
    """``tensor`` as a wire ``Tensor`` called ``name``; ValueError for a dtype, rank or size the wire refuses."""
    element_type = dtype_name(tensor, name)
    _check_shape(name, tuple(tensor.shape), max_elements)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return pb.Tensor(name=name, dtype=element_type, shape=tensor.shape, data=flat.view(torch.uint8).numpy().tobytes())


def decode(message: pb.Tensor, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> torch.Tensor:
    """The tensor in ``message``, viewing its bytes; ValueError naming the field that is wrong."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise ValueError(f"tensor {message.name!r}: unknown dtype {message.dtype!r}; supported: {', '.join(DTYPES)}")
    shape = tuple(message.shape)
    count = _check_shape(message.name, shape, max_elements)
    expected = count * dtype.itemsize
    if len(message.data) != expected:
        raise ValueError(
            f"tensor {message.name!r}: data holds {len(message.data)} bytes, but shape {list(shape)} of "
            f"{message.dtype} needs {expected}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(message.data, dtype=dtype).view(shape)


def encode_all(tensors: Mapping[str, torch.Tensor], *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> list[pb.Tensor]:
    """Every tensor of ``tensors``, encoded under its key."""
    return [encode(name, tensor, max_elements=max_elements) for name, tensor in tensors.items()]


def decode_all(messages: Iterable[pb.Tensor], *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> dict[str, torch.Tensor]:
    """The decoded tensors by name; ValueError for an empty or repeated name."""
    tensors: dict[str, torch.Tensor] = {}
    for message in messages:
        if not message.name:
            raise ValueError("a tensor has an empty name")
        if message.name in tensors:
            raise ValueError(f"tensor {message.name!r} appears more than once")
        tensors[message.name] = decode(message, max_elements=max_elements)
    return tensors


def _check_shape(name: str, shape: tuple[int, ...], max_elements: int) -> int:
    """The element count of ``shape`` after checking rank, signs and the element cap."""
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensor {name!r}: {len(shape)} dimensions, at most {MAX_DIMS} allowed")
    if any(dim < 0 for dim in shape):
        raise ValueError(f"tensor {name!r}: negative dimension in shape {list(shape)}")
    count = math.prod(shape)
    if count > max_elements:
        raise ValueError(f"tensor {name!r}: {count} elements, at most {max_elements} allowed")
    return count
