"""Which runnable requests form the next denoising step: one rule, used by the engine loop and by the admission
replay that predicts it.

Only requests of one image size share a denoiser forward. The step takes the size whose runnable requests fill the
most rows (ties: the oldest request's size), anchored at its oldest request, then adds every other request of that
size that still fits, oldest first: a request that does not fit does not stop a smaller, younger one behind it.
Fairness bound: a request is passed over in a step that runs a younger request without it (its size was not
picked, or it did not fit where a younger one did). Passed over ``max_skipped_steps`` times since it last ran, it
anchors the next step (the most passed over first), whatever its size. A request waiting only behind older ones
is not passed over: within one size, requests start in arrival order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class Slot:
    """A runnable request as the scheduler sees it: denoiser rows, image size, steps passed over since it last ran."""

    rows: int
    size: Hashable = None
    skipped: int = 0


def pick_batch(slots: Sequence[Slot], max_rows: int, max_skipped_steps: int) -> list[int]:
    """Indices into ``slots`` (oldest first) of the next step's requests, ascending; [] when there are none. The
    anchor always runs, even alone past ``max_rows``."""
    if not slots:
        return []
    anchor = _starving(slots, max_skipped_steps)
    if anchor is None:
        filled: dict[Hashable, int] = {}
        for slot in slots:
            filled[slot.size] = filled.get(slot.size, 0) + slot.rows
        best = max(min(total, max_rows) for total in filled.values())
        anchor = next(i for i, slot in enumerate(slots) if min(filled[slot.size], max_rows) == best)
    size, rows = slots[anchor].size, slots[anchor].rows
    batch = [anchor]
    for index, slot in enumerate(slots):
        if index != anchor and slot.size == size and rows + slot.rows <= max_rows:
            batch.append(index)
            rows += slot.rows
    return sorted(batch)


def record_steps(slots: Sequence[Slot], batch: Sequence[int], steps: int = 1) -> None:
    """After ``steps`` steps of ``batch``: its requests' ``skipped`` back to 0, up by ``steps`` for each request
    passed over."""
    for index in _passed_over(slots, batch):
        slots[index].skipped += steps
    for index in batch:
        slots[index].skipped = 0


def steps_until_change(slots: Sequence[Slot], batch: Sequence[int], steps_left: Sequence[int],
                       max_skipped_steps: int) -> int:
    """How many steps ``batch`` stays the pick (no request finishes, none reaches the fairness bound): the replay
    jumps that far at once."""
    if _starving(slots, max_skipped_steps) is not None:
        return 1  # the starving anchor's count resets after one step, which changes the next pick
    until_finish = min(steps_left[i] for i in batch)
    until_starving = [max_skipped_steps - slots[i].skipped for i in _passed_over(slots, batch)]
    return max(1, min([until_finish, *until_starving]))


def _passed_over(slots: Sequence[Slot], batch: Sequence[int]) -> list[int]:
    """Requests not in ``batch`` that are older than one in it (slots are oldest first)."""
    youngest = max(batch, default=-1)
    stepped = set(batch)
    return [index for index in range(youngest) if index not in stepped]


def _starving(slots: Sequence[Slot], max_skipped_steps: int) -> int | None:
    starving = [i for i, slot in enumerate(slots) if slot.skipped >= max_skipped_steps]
    return max(starving, key=lambda i: slots[i].skipped) if starving else None
