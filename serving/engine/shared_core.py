"""Engine loops that share one device take turns at it, one denoising step at a time.

Several models in one replica each have an engine loop. Left to the OS, their steps would share the cores at
once, every request on them slowed together. ``SharedCore`` grants the device to one loop's step at a time: the loop
whose batch holds the request of the earliest ideal finish (its submission time plus its steps at its fastest
step time), so requests finish about in that order and a loop's step time stays its own. Each loop's admission
adds the other loops' work that would run first (``backlog_s``) to its own predicted wait.
"""

from __future__ import annotations

import abc
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CoreMember(abc.ABC):
    """An engine loop on a ``SharedCore``."""

    @abc.abstractmethod
    def backlog_s(self, before: float) -> float:
        """Seconds of denoising this loop has left for its requests whose ideal finish is earlier than ``before``."""


class SharedCore:
    """A turn at the device for one step of one member at a time, earliest ideal finish first (ties: first come)."""

    def __init__(self) -> None:
        self._members: list[CoreMember] = []
        self._turns = threading.Condition()
        self._waiting: set[tuple[float, int]] = set()
        self._taken = False
        self._tickets = itertools.count()

    def join(self, member: CoreMember) -> None:
        with self._turns:
            self._members.append(member)

    def leave(self, member: CoreMember) -> None:
        """Nothing when ``member`` has left already."""
        with self._turns:
            if member in self._members:
                self._members.remove(member)

    @contextmanager
    def turn(self, ideal_finish: float) -> Iterator[None]:
        """Blocks until no other step runs and none waiting has an earlier ``ideal_finish``; the step runs in the
        block."""
        ticket = (ideal_finish, next(self._tickets))
        with self._turns:
            self._waiting.add(ticket)
            while self._taken or min(self._waiting) != ticket:
                self._turns.wait()
            self._waiting.remove(ticket)
            self._taken = True
        try:
            yield
        finally:
            with self._turns:
                self._taken = False
                self._turns.notify_all()

    def backlog_s(self, member: CoreMember, before: float) -> float:
        """Seconds of the other members' denoising that would run before a request of ideal finish ``before``."""
        with self._turns:
            others = [other for other in self._members if other is not member]
        return sum(other.backlog_s(before) for other in others)
