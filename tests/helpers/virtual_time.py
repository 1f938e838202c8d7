"""An asyncio event loop on virtual time: when nothing is ready, the loop's clock jumps to the next timer instead of
waiting for it, so a test of timing (queues, SLOs) gives the same answer however busy the machine is."""

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _SkipAheadSelector(selectors.DefaultSelector):
    """Polls the real file descriptors without waiting; a wait for a timer advances ``loop`` instead."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer pending: only real I/O can wake the loop
            return super().select(None)
        self._loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is ``now``, which moves only when every task waits for a timer."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_SkipAheadSelector(self))

    def time(self) -> float:
        return self.now


def run_in_virtual_time(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coroutine)
