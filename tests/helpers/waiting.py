"""Waiting in a test for a condition, not for the clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], failure: str | Callable[[], str], *running: Future, timeout_s: float,
             period_s: float) -> T:
    """``condition()``'s first truthy value, polled every ``period_s``. The test fails with ``failure`` (called then,
    so it can say what was last seen) past ``timeout_s`` (a bound on a hang, not a speed claim) or once any of
    ``running`` has ended (what the condition waits on can then no longer happen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline or any(future.done() for future in running):
            raise AssertionError(failure() if callable(failure) else failure)
        time.sleep(period_s)
