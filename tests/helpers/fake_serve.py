"""Stand-ins for Ray's object store and Serve deployment handles, to run the wire paths in one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class FakeStore:
    """An object store in a dict: ``put`` returns a ref with ``hex()`` and counts puts, ``get`` counts fetches."""

    class Ref:
        def __init__(self, key: str) -> None:
            self.key = key

        def hex(self) -> str:
            return self.key

    def __init__(self) -> None:
        self.objects: dict[str, np.ndarray] = {}
        self.puts = 0
        self.gets = 0

    def put(self, array: np.ndarray) -> FakeStore.Ref:
        self.puts += 1
        ref = self.Ref(f"obj{self.puts}")
        self.objects[ref.key] = array
        return ref

    def get(self, ref: FakeStore.Ref) -> np.ndarray:
        self.gets += 1
        return self.objects[ref.key]


class Answered:
    """A deployment response already answered."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self, timeout_s: float | None = None) -> Any:
        return self._value


class FakeMethod:
    """A handle method: ``remote(...)`` runs ``answer`` at once, and keeps each call's arguments and answer."""

    def __init__(self, answer: Callable[..., Any]) -> None:
        self._answer = answer
        self.calls: list[tuple] = []
        self.answers: list[Any] = []

    def remote(self, *args: Any) -> Answered:
        self.calls.append(args)
        self.answers.append(self._answer(*args))
        return Answered(self.answers[-1])


class FakeHandle:
    """A deployment handle whose methods are ``FakeMethod``s."""

    def __init__(self, **methods: Callable[..., Any]) -> None:
        for name, answer in methods.items():
            setattr(self, name, FakeMethod(answer))
