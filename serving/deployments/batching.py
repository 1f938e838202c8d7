"""One ``@serve.batch`` of step calls from many replicas, run as one forward per latent shape."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

Call = TypeVar("Call")
Answer = TypeVar("Answer")


async def forward_by_shape(calls: Sequence[Call], shape: Callable[[Call], Hashable],
                           forward: Callable[[list[Call]], list[Answer]]) -> list[Answer]:
    """``forward`` once per group of ``calls`` with the same ``shape`` (only those can share a forward), each on a
    worker thread, one after the other; the answers in the order of ``calls``."""
    groups: dict[Hashable, list[int]] = {}
    for index, call in enumerate(calls):
        groups.setdefault(shape(call), []).append(index)
    answers: dict[int, Answer] = {}
    for indices in groups.values():
        group = await asyncio.to_thread(forward, [calls[i] for i in indices])
        answers.update(zip(indices, group, strict=True))
    return [answers[index] for index in range(len(calls))]
