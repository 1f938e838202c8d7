"""Torch tensors across Ray as numpy arrays: pickle-5 buffers instead of torch's own pickling.

Torch pickles a tensor by saving its storage with ``torch.save`` into bytes (about 50 µs per small tensor each way);
a numpy array travels as an out-of-band buffer. ``register_ray_serializer`` makes Ray send every plain CPU tensor of
the calling process as its numpy array (a process sending tensors calls it: a replica for its answers, a caller
for its requests); anything else (autograd, other devices, layouts or dtypes numpy lacks but bfloat16) keeps
torch's own pickling.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import numpy as np
import torch

#: dtypes numpy lacks that travel as another dtype of their width, reinterpreted on arrival
_REINTERPRETED = {torch.bfloat16: torch.int16}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu").contiguous().numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor sharing its memory (which may be read-only: nothing may write to it)."""
    with warnings.catch_warnings():  # object-store buffers are read-only; nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def register_ray_serializer() -> None:
    """From now on, Ray serializes this process's plain CPU tensors as numpy arrays (``_serialize``)."""
    import ray.util

    ray.util.register_serializer(torch.Tensor, serializer=_serialize, deserializer=_deserialize)


def _serialize(tensor: torch.Tensor) -> tuple[str, Any]:
    plain = (tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.requires_grad
             and not tensor.is_conj() and not tensor.is_neg() and not tensor.is_quantized)
    if plain:
        carrier = _REINTERPRETED.get(tensor.dtype)
        try:
            array = (tensor.view(carrier) if carrier is not None else tensor).numpy()
        except TypeError:  # a dtype numpy lacks
            pass
        else:
            return str(tensor.dtype).removeprefix("torch."), array
    return "pickle", pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)


def _deserialize(state: tuple[str, Any]) -> torch.Tensor:
    kind, value = state
    if kind == "pickle":
        return pickle.loads(value)
    # Arrays Ray hands out may view read-only buffers; a tensor the receiver may write to needs its own memory.
    tensor = from_numpy(value if value.flags.writeable else value.copy())
    dtype = getattr(torch, kind)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor
