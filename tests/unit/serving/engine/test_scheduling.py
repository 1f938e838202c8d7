"""The batch rule (``serving.engine.scheduling``) and the engine loop that follows it: no head-of-line blocking,
and a fairness bound."""

import itertools
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.config import EngineConfig
from serving.engine import EngineLoop, GenerationParams
from serving.engine.scheduling import Slot, pick_batch, record_steps

TIMEOUT_S = 60


@pytest.mark.parametrize(("slots", "max_rows", "expected"), [
    ([], 16, []),
    ([Slot(10), Slot(8), Slot(2)], 16, [0, 2]),                     # 8 does not fit: the younger 2 still joins
    ([Slot(20), Slot(2)], 16, [0]),                                  # the anchor runs alone past the limit
    ([Slot(2, "a"), Slot(2, "b"), Slot(2, "b")], 16, [1, 2]),       # the size that fills more rows goes first
    ([Slot(2, "a"), Slot(2, "b")], 16, [0]),                         # a tie: the oldest request's size
    ([Slot(8, "a"), Slot(8, "a"), Slot(6, "b"), Slot(6, "b")], 8, [0]),  # fills capped at max_rows: a tie
    ([Slot(2, "a"), Slot(2, "b"), Slot(2, "b", skipped=8)], 16, [1, 2]),
    ([Slot(2, "a", skipped=8), Slot(2, "b"), Slot(2, "b")], 16, [0]),     # passed over 8 times: it anchors
    ([Slot(2, "a", skipped=8), Slot(2, "b", skipped=9), Slot(2, "a")], 16, [1]),  # the most passed over first
])
def test_pick_batch(slots, max_rows, expected):
    assert pick_batch(slots, max_rows, max_skipped_steps=8) == expected


def test_only_a_request_older_than_one_that_ran_is_passed_over():
    slots = [Slot(2, "a"), Slot(2, "b"), Slot(2, "a", skipped=3), Slot(2, "c", skipped=1)]
    record_steps(slots, [1], steps=2)
    assert [slot.skipped for slot in slots] == [2, 0, 3, 1]  # only slot 0 is older than the one that ran


@st.composite
def _arrivals(draw):
    """Per step, the requests arriving: (rows, size, steps)."""
    return draw(st.lists(st.lists(st.tuples(st.integers(1, 6), st.sampled_from("abc"), st.integers(1, 12)),
                                  max_size=3), min_size=1, max_size=40))


@given(arrivals=_arrivals(), max_rows=st.integers(1, 12), bound=st.integers(1, 6))
def test_no_request_is_passed_over_past_the_bound_and_the_number_waiting_ahead_of_it(arrivals, max_rows, bound):
    """Whatever arrives, a request passed over ``bound`` times runs within as many more steps as there are
    requests that were passed over as often (each anchors at most one step before it)."""
    line: list[list] = []  # [slot, steps_left]
    worst_excess = 0
    for step in range(len(arrivals) + 12 * 40):
        line += [[Slot(rows, size), steps] for rows, size, steps in (arrivals[step] if step < len(arrivals) else [])]
        if not line:
            continue
        slots = [slot for slot, _ in line]
        batch = pick_batch(slots, max_rows, bound)
        assert batch
        record_steps(slots, batch)
        for index in batch:
            line[index][1] -= 1
        line = [entry for entry in line if entry[1] > 0]
        worst_excess = max([worst_excess, *(slot.skipped - bound - len(line) for slot, _ in line)])
    assert not line  # everything finished
    assert worst_excess <= 0


# -- in the engine loop -------------------------------------------------------------------------------------------


def _params(width: int, seed: int, steps: int = 6) -> GenerationParams:
    return GenerationParams(prompt="a red circle", width=width, height=64, num_inference_steps=steps,
                            guidance_scale=7.5, seed=seed)


def test_loop_steps_the_fuller_size_first_and_the_passed_over_request_within_the_bound(tiny_engine, monkeypatch):
    batches: list[list[int]] = []  # seeds of each step's requests
    step = tiny_engine.step
    monkeypatch.setattr(tiny_engine, "step", lambda states: (batches.append([s.params.seed for s in states]),
                                                             step(states)))
    reached, release = threading.Event(), threading.Event()

    def hold(state):  # the oldest request, alone, after 2 of its 6 steps: the others queue meanwhile
        if state.params.seed == 1 and state.step_index == 2 and not release.is_set():
            reached.set()
            assert release.wait(TIMEOUT_S)

    loop = EngineLoop(tiny_engine, EngineConfig(max_skipped_steps=2, admission_wait_fraction=None), on_step=hold)
    try:
        oldest = loop.submit(_params(64, seed=1))
        assert reached.wait(TIMEOUT_S)
        others = [loop.submit(_params(128, seed=2)), loop.submit(_params(128, seed=3))]
        deadline = time.monotonic() + TIMEOUT_S
        while not all(s.prepared.done() for s in loop._queue) and time.monotonic() < deadline:
            time.sleep(0.002)
        release.set()
        results = [future.result(timeout=TIMEOUT_S) for future in (oldest, *others)]
    finally:
        release.set()
        loop.stop()
    assert all(len(result.images) == 1 for result in results)
    assert batches[:3] == [[1], [1], [2, 3]]  # 4 rows of 128 px before the oldest's 2 rows of 64 px
    runs_of_1 = [i for i, batch in enumerate(batches) if 1 in batch]
    gaps = [later - earlier - 1 for earlier, later in itertools.pairwise(runs_of_1)]
    assert max(gaps) == 2  # passed over twice, then it anchors the next step


@pytest.mark.parametrize("stage", ["decode", "start"])
def test_the_stage_thread_never_stops_the_running_requests(tiny_engine, monkeypatch, stage):
    """A held VAE decode (of a finished request) or text encoding (of a new one) leaves the running request
    denoising to its last step meanwhile."""
    held, release, denoised = threading.Event(), threading.Event(), threading.Event()
    original = getattr(tiny_engine, stage)

    def slow(*args, **kwargs):
        params = args[0].params if stage == "decode" else args[0]
        if params.seed == 1:
            held.set()
            assert release.wait(TIMEOUT_S)
        return original(*args, **kwargs)

    def on_step(state):
        if state.params.seed == 2 and state.done:
            denoised.set()

    monkeypatch.setattr(tiny_engine, stage, slow)
    loop = EngineLoop(tiny_engine, EngineConfig(admission_wait_fraction=None), on_step=on_step)
    try:
        running = loop.submit(_params(64, seed=2, steps=12))
        if stage == "decode":  # a short request finishes first and its decode is held
            held_request = loop.submit(_params(64, seed=1, steps=1))
        else:
            held_request = loop.submit(_params(64, seed=1))
        assert held.wait(TIMEOUT_S)
        assert denoised.wait(TIMEOUT_S)  # all 12 steps ran while the stage was held
        assert not held_request.done()
        release.set()
        assert running.result(timeout=TIMEOUT_S).images and held_request.result(timeout=TIMEOUT_S).images
    finally:
        release.set()
        loop.stop()
