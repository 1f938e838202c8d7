"""py-spy's raw (collapsed) stacks summed per frame, for the profile scripts' flame summaries."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator

from benchmarks.records import REPO

#: What a frame's path is cut after: site-packages, the standard library, this repository.
_PREFIX = re.compile(r"^.*(site-packages/|lib/python3\.\d+/|" + re.escape(str(REPO)) + "/)")


def _samples(collapsed: str) -> Iterator[tuple[list[str], int]]:
    """Each sample line of py-spy's raw (collapsed) output, ``frame;frame;... count``, as its frames and count."""
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def frame_totals(collapsed: str) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Samples in all, per frame inclusive (counted once per stack) and per frame self (leaf), from py-spy's raw
    (collapsed) output."""
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for stack, samples in _samples(collapsed):
        frames = [short_frame(frame) for frame in stack]
        total += samples
        for frame in set(frames[1:]):  # the first is the thread
            inclusive[frame] += samples
        leaf[frames[-1]] += samples
    return total, inclusive, leaf


def short_frame(frame: str) -> str:
    """``function (path/to/file.py:line)`` with the path cut to its package-relative tail and no line."""
    name, _, where = frame.partition(" (")
    where = _PREFIX.sub("", where.rstrip(")").rsplit(":", 1)[0])
    return f"{name} ({where})" if where else name


def thread_samples(collapsed: str) -> collections.Counter[str]:
    """Samples per thread (the first frame of each stack of ``py-spy record --threads``)."""
    threads: collections.Counter[str] = collections.Counter()
    for stack, samples in _samples(collapsed):
        threads[stack[0]] += samples
    return threads
