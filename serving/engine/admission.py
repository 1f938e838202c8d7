"""Admission by predicted wait: a request that would wait too long for its first step is refused at once.

The engine loop replays its own schedule (oldest requests whose rows fit ``max_batch_rows`` step together, finished
ones leave, the next join) to predict how many steps a new request would wait before it first runs, and refuses it
when that exceeds ``EngineConfig.admission_wait_fraction`` of its own steps. The replay assumes one image size and
no request stopped for its LoRA, so mixed sizes make it optimistic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serving.common.errors import APIError, retry_after


@dataclass(frozen=True)
class Work:
    """A request as the schedule sees it: UNet rows per step and denoising steps left."""

    rows: int
    steps_left: int


class EngineOverloaded(APIError):
    """The request would wait ``wait_steps`` steps (about ``wait_s`` seconds) before its first: 503, retry after
    the predicted wait."""

    def __init__(self, wait_steps: int, allowed_steps: float, wait_s: float) -> None:
        super().__init__(503, f"the model is at capacity: this request would wait {wait_steps} denoising steps "
                         f"(about {wait_s:.1f} s) before its first, more than the {allowed_steps:g} allowed",
                         code="overloaded", headers=retry_after(wait_s))
        self.wait_steps = wait_steps
        self.wait_s = wait_s


def wait_steps(running: Sequence[Work], queued: Sequence[Work], new: Work, max_batch_rows: int,
               continuous_batching: bool = True) -> int:
    """Steps before ``new`` first runs, after ``running`` and then ``queued`` (each oldest first).

    With continuous batching queued requests join at the next step boundary, so all of them are one line;
    without it they join only once every running request has finished.
    """
    if continuous_batching:
        return _steps_until_started([*running, *queued, new], max_batch_rows)
    return _steps_until_drained(running, max_batch_rows) + _steps_until_started([*queued, new], max_batch_rows)


def _batch(line: list[list[int]], max_batch_rows: int) -> list[list[int]]:
    """The oldest entries (``[rows, steps_left]``) whose rows fit together, as the loop picks a step's batch."""
    batch, rows = [], 0
    for entry in line:
        if batch and rows + entry[0] > max_batch_rows:
            break
        batch.append(entry)
        rows += entry[0]
    return batch


def _advance(line: list[list[int]], max_batch_rows: int) -> tuple[int, list[list[int]]]:
    """Runs the current batch until its first request finishes: (steps taken, the line after)."""
    batch = _batch(line, max_batch_rows)
    taken = min(entry[1] for entry in batch)
    for entry in batch:
        entry[1] -= taken
    return taken, [entry for entry in line if entry[1] > 0]


def _steps_until_started(works: Sequence[Work], max_batch_rows: int) -> int:
    *ahead, last = works
    line = [[work.rows, work.steps_left] for work in ahead if work.steps_left > 0]
    target = [last.rows, max(1, last.steps_left)]
    line.append(target)
    elapsed = 0
    while not any(entry is target for entry in _batch(line, max_batch_rows)):
        taken, line = _advance(line, max_batch_rows)
        elapsed += taken
    return elapsed


def _steps_until_drained(works: Sequence[Work], max_batch_rows: int) -> int:
    line = [[work.rows, work.steps_left] for work in works if work.steps_left > 0]
    elapsed = 0
    while line:
        taken, line = _advance(line, max_batch_rows)
        elapsed += taken
    return elapsed
