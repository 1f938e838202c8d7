"""Admission by predicted wait: a request that would wait too long for its first step is refused at once.

The engine loop replays its own schedule (``serving.engine.scheduling``: the batch rule, finished requests
leaving, the next joining) to predict how many steps a new request would wait before it first runs, and refuses it
when that exceeds ``EngineConfig.admission_wait_fraction`` of its own steps. The replay assumes no request stops
for its LoRA. With ``EngineConfig.admission_max_slowdown`` it also refuses, while busy, a request whose wait and own
steps at the current step time exceed that many times its own steps at the fastest step time seen for its rows:
steps count the wait, not how long a step takes once full batches and other processes on the core stretch it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from serving.common.errors import APIError, retry_after
from serving.engine.scheduling import Slot, pick_batch, record_steps, steps_until_change


@dataclass(frozen=True)
class Work:
    """A request as the schedule sees it: denoiser rows per step, denoising steps left, image size, and steps passed
    over in a row."""

    rows: int
    steps_left: int
    size: Hashable = None
    skipped: int = 0


class EngineOverloaded(APIError):
    """The model is past capacity for this request (``reason``); it would wait ``wait_steps`` steps (about
    ``wait_s`` seconds) before its first: 503, retry after the predicted wait."""

    def __init__(self, reason: str, wait_steps: int, wait_s: float) -> None:
        super().__init__(503, f"the model is at capacity: {reason}", code="overloaded",
                         headers=retry_after(wait_s))
        self.wait_steps = wait_steps
        self.wait_s = wait_s

    @classmethod
    def waiting(cls, wait_steps: int, allowed_steps: float, wait_s: float) -> EngineOverloaded:
        """It would wait more than ``allowed_steps`` before its first."""
        return cls(f"this request would wait {wait_steps} denoising steps (about {wait_s:.1f} s) before its first, "
                   f"more than the {allowed_steps:g} allowed", wait_steps, wait_s)

    @classmethod
    def slowed(cls, predicted_s: float, alone_s: float, max_slowdown: float, wait_steps: int,
               wait_s: float) -> EngineOverloaded:
        """Its denoising would take ``predicted_s``, more than ``max_slowdown`` x its ``alone_s`` alone."""
        return cls(f"this request would take about {predicted_s:.2f} s to denoise, more than {max_slowdown:g} x "
                   f"its {alone_s:.2f} s alone", wait_steps, wait_s)


def wait_steps(running: Sequence[Work], queued: Sequence[Work], new: Work, max_batch_rows: int,
               continuous_batching: bool = True, max_skipped_steps: int = 8) -> int:
    """Steps before ``new`` first runs, after ``running`` and then ``queued`` (each oldest first).

    With continuous batching queued requests join at the next step boundary, so all of them are one line;
    without it they join only once every running request has finished.
    """
    if continuous_batching:
        return _replay([*running, *queued], new, max_batch_rows, max_skipped_steps)
    return (_replay(running, None, max_batch_rows, max_skipped_steps)
            + _replay(queued, new, max_batch_rows, max_skipped_steps))


def steps_to_finish(works: Sequence[Work], max_batch_rows: int, max_skipped_steps: int = 8) -> int:
    """Steps until every request of ``works`` (oldest first, joined at once) has finished."""
    return _replay(works, None, max_batch_rows, max_skipped_steps)


def _replay(ahead: Sequence[Work], new: Work | None, max_batch_rows: int, max_skipped_steps: int) -> int:
    """Steps until ``new`` is first in a batch (``None``: until every request of ``ahead`` has finished), jumping
    from one change of the batch to the next."""
    works = [work for work in ahead if work.steps_left > 0]
    if new is not None:
        works.append(Work(new.rows, max(1, new.steps_left), new.size, new.skipped))
    slots = [Slot(work.rows, work.size, work.skipped) for work in works]
    target = slots[-1] if new is not None else None
    steps_left = [work.steps_left for work in works]
    elapsed = 0
    while slots:
        batch = pick_batch(slots, max_batch_rows, max_skipped_steps)
        if any(slots[i] is target for i in batch):
            return elapsed
        taken = steps_until_change(slots, batch, steps_left, max_skipped_steps)
        record_steps(slots, batch, taken)
        for i in batch:
            steps_left[i] -= taken
        kept = [i for i, left in enumerate(steps_left) if left > 0]
        slots, steps_left = [slots[i] for i in kept], [steps_left[i] for i in kept]
        elapsed += taken
    return elapsed
