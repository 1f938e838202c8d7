"""Moving tensors between Serve replicas without needless copies.

Arrays travel as numpy. Inputs many calls share (a request's conditioning image, its text embeddings) are
``ray.put`` once by the sender (``SharedTensors``) and resolved once per receiving replica (``ResolvedTensors``);
neither side keeps them longer than the requests that use them. ``put`` and ``get`` default to Ray's object store;
tests pass their own.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
import torch

from serving.common.tensors import from_numpy, to_numpy
from serving.controlnet.runner import ContextRow

_RESOLVED_BYTES = 256 * 2**20  # a receiver's resolved tensors at most
_RESOLVED_IDLE_S = 30.0  # a resolved tensor no call used for this long is dropped


class SharedTensors:
    """Sender side: one object-store reference per live tensor, dropped when the tensor is freed (the reference
    lives exactly as long as the request's own copy). ``sent`` is told the bytes of each put."""

    def __init__(self, put: Callable[[np.ndarray], Any] = ray.put, *,
                 sent: Callable[[int], None] = lambda nbytes: None) -> None:
        self._put = put
        self._sent = sent
        self._refs: dict[int, tuple[weakref.ref, Any]] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def ref(self, tensor: torch.Tensor) -> Any:
        key = id(tensor)
        entry = self._refs.get(key)
        if entry is None or entry[0]() is not tensor:
            array = to_numpy(tensor)
            entry = (weakref.ref(tensor, lambda _, key=key: self._forget(key)), self._put(array))
            self._refs[key] = entry
            self._sent(array.nbytes)
        return entry[1]

    def rows(self, rows: Sequence[ContextRow]) -> list[tuple[Any, int]]:
        """``rows`` with each tensor as its reference (``ResolvedTensors.rows`` turns them back)."""
        return [(self.ref(tensor), index) for tensor, index in rows]

    def _forget(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is not None and entry[0]() is None:  # not a newer tensor that took the same id
            del self._refs[key]


class ResolvedTensors:
    """Receiver side: each reference fetched once, kept while calls keep using it; a tensor no call used for
    ``idle_s`` is dropped, and the least recently used go when ``max_bytes`` is exceeded."""

    def __init__(self, get: Callable[[Any], np.ndarray] = ray.get, *, max_bytes: int = _RESOLVED_BYTES,
                 idle_s: float = _RESOLVED_IDLE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._get = get
        self._max_bytes = max_bytes
        self._idle_s = idle_s
        self._clock = clock
        self._tensors: OrderedDict[str, tuple[torch.Tensor, float]] = OrderedDict()  # least recently used first
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, ref: Any) -> torch.Tensor:
        now = self._clock()
        self._drop_idle(now)
        key = ref.hex()
        entry = self._tensors.pop(key, None)
        tensor = entry[0] if entry is not None else from_numpy(self._get(ref))
        if entry is None:
            self._bytes += tensor.nbytes
        self._tensors[key] = (tensor, now)
        while self._bytes > self._max_bytes and len(self._tensors) > 1:
            self._evict_oldest()
        return tensor

    def rows(self, rows: Sequence[tuple[Any, int]]) -> list[ContextRow]:
        """``SharedTensors.rows`` resolved."""
        return [(self.get(ref), index) for ref, index in rows]

    def _drop_idle(self, now: float) -> None:
        while self._tensors and now - next(iter(self._tensors.values()))[1] > self._idle_s:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, (tensor, _) = self._tensors.popitem(last=False)
        self._bytes -= tensor.nbytes
