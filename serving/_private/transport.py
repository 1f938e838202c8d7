"""Moving tensors between Serve replicas without needless copies.

Arrays travel as numpy (Ray's object store hands them over without pickling copies). Large inputs
that many calls share, such as a request's conditioning image, are ``ray.put`` once by the sender
(``SharedTensors``) and resolved once per receiving replica (``ResolvedTensors``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np
import ray
import torch

_ENTRIES = 256


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu").contiguous().numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # object-store buffers are read-only; nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class SharedTensors:
    """Sender side: one object-store reference per tensor object, kept for its most recent users."""

    def __init__(self, entries: int = _ENTRIES) -> None:
        self._entries = entries
        self._refs: OrderedDict[int, tuple[torch.Tensor, ray.ObjectRef]] = OrderedDict()

    def ref(self, tensor: torch.Tensor) -> ray.ObjectRef:
        entry = self._refs.get(id(tensor))
        if entry is None or entry[0] is not tensor:  # holding the tensor keeps its id from being reused
            entry = (tensor, ray.put(to_numpy(tensor)))
            self._refs[id(tensor)] = entry
            while len(self._refs) > self._entries:
                self._refs.popitem(last=False)
        self._refs.move_to_end(id(tensor))
        return entry[1]


class ResolvedTensors:
    """Receiver side: each reference fetched once, recently used ones kept as tensors."""

    def __init__(self, entries: int = _ENTRIES) -> None:
        self._entries = entries
        self._tensors: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, ref: ray.ObjectRef) -> torch.Tensor:
        key = ref.hex()
        tensor = self._tensors.get(key)
        if tensor is None:
            tensor = from_numpy(ray.get(ref))
            self._tensors[key] = tensor
            while len(self._tensors) > self._entries:
                self._tensors.popitem(last=False)
        self._tensors.move_to_end(key)
        return tensor
