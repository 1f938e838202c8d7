"""Waiting in a test for a condition, not for the clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

T = TypeVar("T")


class Response(Protocol):
    """What ``first_answer`` reads of an HTTP response (httpx's and requests' alike)."""

    status_code: int
    text: str


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


R = TypeVar("R", bound=Response)


def first_answer(send: Callable[[], R], failure: str, *, timeout_s: float, period_s: float) -> R:
    """The first 200 of ``send()``, sent every ``period_s`` while a replacement replica starts: 503s until then and
    nothing else (any other status fails the test at once)."""
    def answered() -> R | None:
        response = send()
        assert response.status_code in (200, 503), response.text
        return response if response.status_code == 200 else None
    return wait_for(answered, failure, timeout_s=timeout_s, period_s=period_s)
