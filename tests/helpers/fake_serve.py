"""Stand-ins for Ray's object store and Serve deployment handles, to run the wire paths in one process."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
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


class FakeStream:
    """A streaming deployment response: the async generator runs on an event loop of its own thread; ``next``
    waits for its next item (raising what it raised), ``cancel`` stops it after the item in flight."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self._items: queue.Queue = queue.Queue()
        self.cancelled = False
        threading.Thread(target=asyncio.run, args=(self._pump(items),), daemon=True).start()

    async def _pump(self, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                self._items.put((True, item))
                if self.cancelled:
                    break
        except Exception as exc:
            self._items.put((False, exc))
        else:
            self._items.put((False, StopIteration()))

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self) -> Any:
        ok, value = self._items.get(timeout=60)
        if ok:
            return value
        raise value

    def cancel(self) -> None:
        self.cancelled = True


class FakeStreamMethod(FakeMethod):
    """A streaming handle method: ``remote(...)`` starts ``answer`` (an async generator function) as a
    ``FakeStream``."""

    def remote(self, *args: Any) -> FakeStream:  # type: ignore[override]
        self.calls.append(args)
        return FakeStream(self._answer(*args))


class FakeQueue:
    """``ray.util.queue.Queue`` in this process: ``put`` from threads, ``get_async`` from an event loop."""

    def __init__(self) -> None:
        self._items: queue.Queue = queue.Queue()

    def put(self, item: Any, timeout: float | None = None) -> None:
        self._items.put(item, timeout=timeout)

    async def get_async(self, timeout: float | None = None) -> Any:
        return await asyncio.to_thread(self._items.get, timeout=timeout)


class FakeHandle:
    """A deployment handle whose methods are ``FakeMethod``s (callables given are wrapped in one); ``options``
    returns the handle itself."""

    def __init__(self, **methods: Callable[..., Any] | FakeMethod) -> None:
        for name, answer in methods.items():
            setattr(self, name, answer if isinstance(answer, FakeMethod) else FakeMethod(answer))

    def options(self, **_: Any) -> FakeHandle:
        return self
