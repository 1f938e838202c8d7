"""Admission by predicted wait: the schedule replay, and the loop refusing what would wait too long."""

import asyncio
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.common.errors import APIError
from serving.config import EngineConfig
from serving.engine import EngineLoop, EngineOverloaded, GenerationParams, LocalBackend
from serving.engine.admission import Work, wait_steps


def _stepwise_wait(running, queued, new, max_batch_rows, continuous, max_skipped=8):
    """The loop's schedule played one step at a time (the oracle for the event-jumping replay): entries
    [rows, steps_left, size, skipped, is_new], oldest first."""
    line = [[w.rows, w.steps_left, w.size, w.skipped, False] for w in running if w.steps_left > 0]
    waiting = [[w.rows, w.steps_left, w.size, 0, False] for w in queued]
    waiting.append([new.rows, max(1, new.steps_left), new.size, 0, True])
    step = 0
    while True:
        if continuous or not line:
            line, waiting = line + waiting, []
        starving = [entry for entry in line if entry[3] >= max_skipped]
        if starving:
            anchor = max(starving, key=lambda entry: entry[3])
        else:
            fill = {entry[2]: min(max_batch_rows, sum(e[0] for e in line if e[2] == entry[2])) for entry in line}
            anchor = next(entry for entry in line if fill[entry[2]] == max(fill.values()))
        batch, rows = [anchor], anchor[0]
        for entry in line:
            if entry is not anchor and entry[2] == anchor[2] and rows + entry[0] <= max_batch_rows:
                batch.append(entry)
                rows += entry[0]
        if any(entry[4] for entry in batch):
            return step
        youngest = max(line.index(entry) for entry in batch)
        for entry in line[:youngest]:
            if all(entry is not b for b in batch):
                entry[3] += 1
        for entry in batch:
            entry[1] -= 1
            entry[3] = 0
        line = [entry for entry in line if entry[1] > 0]
        step += 1


works = st.builds(Work, rows=st.integers(1, 6), steps_left=st.integers(0, 30))  # 0: done, not yet collected
requests = st.builds(Work, rows=st.integers(1, 6), steps_left=st.integers(1, 30))
sized = st.builds(Work, rows=st.integers(1, 6), steps_left=st.integers(0, 30), size=st.sampled_from("ab"),
                  skipped=st.integers(0, 9))
sized_requests = st.builds(Work, rows=st.integers(1, 6), steps_left=st.integers(1, 30), size=st.sampled_from("ab"))


@given(running=st.lists(works, max_size=8), queued=st.lists(requests, max_size=5), new=requests,
       max_batch_rows=st.integers(1, 16), continuous=st.booleans())
def test_replay_matches_the_schedule_step_by_step(running, queued, new, max_batch_rows, continuous):
    assert (wait_steps(running, queued, new, max_batch_rows, continuous)
            == _stepwise_wait(running, queued, new, max_batch_rows, continuous))


@given(running=st.lists(sized, max_size=8), queued=st.lists(sized_requests, max_size=5), new=sized_requests,
       max_batch_rows=st.integers(1, 16), continuous=st.booleans(), max_skipped=st.integers(1, 10))
def test_replay_matches_the_schedule_with_mixed_sizes_and_the_fairness_bound(running, queued, new, max_batch_rows,
                                                                             continuous, max_skipped):
    assert (wait_steps(running, queued, new, max_batch_rows, continuous, max_skipped)
            == _stepwise_wait(running, queued, new, max_batch_rows, continuous, max_skipped))


@given(running=st.lists(works, max_size=8), extra=works, new=requests, max_batch_rows=st.integers(1, 16))
def test_more_work_ahead_never_shortens_the_wait(running, extra, new, max_batch_rows):
    assert (wait_steps([*running, extra], [], new, max_batch_rows)
            >= wait_steps(running, [], new, max_batch_rows))


@pytest.mark.parametrize(("running", "queued", "new", "expected"), [
    ([], [], Work(2, 20), 0),                                 # idle: starts at once
    ([Work(2, 20)] * 7, [], Work(2, 20), 0),                  # 14 of 16 rows busy: joins the batch
    ([Work(2, 20), Work(2, 3), *[Work(2, 9)] * 6], [], Work(2, 20), 3),  # full: the first to finish frees a place
    ([Work(2, 20)] * 7 + [Work(2, 3)], [Work(2, 20)], Work(2, 20), 20),  # the queued one takes that place first
    ([Work(20, 5)], [], Work(2, 20), 5),                      # a request over the batch runs alone
    ([Work(10, 20), Work(4, 20)], [], Work(2, 20), 0),        # 6 rows do not fit behind 14: 2 do, no blocking
    ([Work(2, 20, "a")], [], Work(2, 20, "b"), 20),           # other size: waits for the one it cannot join
    ([Work(2, 20, "a")], [Work(2, 20, "b")], Work(2, 20, "b"), 0),  # its size fills more rows: it goes first
    ([Work(2, 20, "a", skipped=8), Work(2, 20, "b")], [], Work(2, 20, "b"), 1),  # passed over 8 times: "a" first
])
def test_predicted_waits(running, queued, new, expected):
    assert wait_steps(running, queued, new, max_batch_rows=16) == expected


def test_without_continuous_batching_a_request_waits_for_all_running_ones():
    assert wait_steps([Work(2, 3), Work(2, 9)], [], Work(2, 5), 16, continuous_batching=False) == 9
    assert wait_steps([Work(2, 3), Work(2, 9)], [], Work(2, 5), 16, continuous_batching=True) == 0


# -- in the engine loop -------------------------------------------------------------------------------------------


def _params(steps: int, seed: int) -> GenerationParams:
    return GenerationParams(prompt="a red circle", width=64, height=64, num_inference_steps=steps,
                            guidance_scale=7.5, seed=seed)


def _held_at(step: int, steps: int = 30):
    """An ``on_step`` hook that holds the ``steps``-step request at ``step`` until released."""
    reached, release = threading.Event(), threading.Event()

    def on_step(state):
        if state.params.num_inference_steps == steps and state.step_index == step:
            reached.set()
            release.wait(timeout=60)
    return on_step, reached, release


def test_loop_refuses_what_would_wait_past_its_fraction_and_admits_when_a_place_is_near(tiny_engine):
    alone = EngineLoop(tiny_engine, EngineConfig())
    try:
        expected = alone.submit(_params(30, seed=1)).result(timeout=120).images
    finally:
        alone.stop()
    on_step, reached, release = _held_at(2)
    loop = EngineLoop(tiny_engine, EngineConfig(max_batch_rows=2, admission_wait_fraction=0.25), on_step=on_step)
    try:
        long = loop.submit(_params(30, seed=1))  # 2 rows: the whole batch
        assert reached.wait(timeout=60)
        with pytest.raises(EngineOverloaded) as refused:
            loop.submit(_params(30, seed=2))  # would wait 28 steps, 7.5 allowed
        assert refused.value.wait_steps == 28 and refused.value.wait_s > 0
        short = loop.submit(_params(120, seed=3))  # 28 of 30 allowed: admitted
        release.set()
        assert long.result(timeout=120).images == expected  # the refusal touched nothing
        assert len(short.result(timeout=300).images) == 1
    finally:
        release.set()
        loop.stop()


def test_backend_answers_a_refusal_with_503_overloaded_and_the_wait_as_retry_after(tiny_engine):
    on_step, reached, release = _held_at(1)
    backend = LocalBackend(EngineLoop(tiny_engine, EngineConfig(max_batch_rows=2, admission_wait_fraction=0.0),
                                      on_step=on_step))
    try:
        running = backend.loop.submit(_params(30, seed=1))
        assert reached.wait(timeout=60)
        with pytest.raises(APIError) as refused:
            asyncio.run(backend.generate(_params(4, seed=2)))
        error = refused.value
        assert (error.status_code, error.code) == (503, "overloaded")
        assert int(error.headers["Retry-After"]) >= 1
        release.set()
        assert running.result(timeout=120).images
    finally:
        release.set()
        backend.close()



@pytest.mark.parametrize("bound", [3.0, None])
def test_loop_refuses_while_busy_what_would_denoise_past_its_slowdown_and_admits_when_idle(tiny_engine, monkeypatch,
                                                                                          bound):
    """Steps stretched (as by other processes on the core) after the running request's third, each by 10x the
    fastest step before, so past 3x the fastest however loaded the machine: a 4-step request joining its batch (no
    wait) is refused, predicted far past 3x its steps alone, and admitted once the loop is idle; with the bound off
    (None) it is admitted while busy."""
    stretched, reached, release = threading.Event(), threading.Event(), threading.Event()
    step = tiny_engine.step
    unstretched: list[float] = []  # seconds of each step before the stretch

    def stretched_step(states):
        started = time.perf_counter()
        result = step(states)
        if stretched.is_set():
            time.sleep(10 * min(unstretched))
        else:
            unstretched.append(time.perf_counter() - started)
        return result

    def on_step(state):
        if state.params.num_inference_steps == 30 and state.step_index == 3:
            stretched.set()
        if state.params.num_inference_steps == 30 and state.step_index == 25:
            reached.set()
            release.wait(timeout=60)

    monkeypatch.setattr(tiny_engine, "step", stretched_step)
    loop = EngineLoop(tiny_engine, EngineConfig(admission_wait_fraction=None, admission_max_slowdown=bound),
                      on_step=on_step)
    try:
        running = loop.submit(_params(30, seed=1))
        assert reached.wait(timeout=60)
        if bound is None:
            joined = loop.submit(_params(4, seed=2))
        else:
            with pytest.raises(EngineOverloaded, match="to denoise, more than 3 x") as refused:
                loop.submit(_params(4, seed=2))
            assert (refused.value.status_code, refused.value.wait_steps) == (503, 0)
        release.set()
        assert running.result(timeout=120).images
        if bound is None:
            assert joined.result(timeout=120).images
        else:
            assert loop.submit(_params(4, seed=3)).result(timeout=120).images  # idle: admitted
    finally:
        release.set()
        loop.stop()
