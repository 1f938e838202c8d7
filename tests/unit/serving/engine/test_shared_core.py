"""Engine loops sharing a device: one step at a time, earliest ideal finish first, and admission that counts the
other loops' work ahead."""

import threading
import time

import pytest

from serving.config import DiffusionModelConfig, EngineConfig
from serving.engine import DiffusionEngine, EngineLoop, EngineOverloaded, GenerationParams
from serving.engine.shared_core import CoreMember, SharedCore


class _Member(CoreMember):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.asked: list[float] = []

    def backlog_s(self, before: float) -> float:
        self.asked.append(before)
        return self.seconds


def test_turns_go_to_the_earliest_ideal_finish_one_at_a_time():
    core = SharedCore()
    order, inside, overlapped = [], [], []
    held, release = threading.Event(), threading.Event()

    def step(ideal_finish: float, hold: bool = False) -> None:
        with core.turn(ideal_finish):
            if inside:
                overlapped.append(ideal_finish)
            inside.append(ideal_finish)
            order.append(ideal_finish)
            if hold:
                held.set()
                release.wait(timeout=10)
            inside.remove(ideal_finish)

    first = threading.Thread(target=step, args=(5.0, True))
    first.start()
    assert held.wait(timeout=10)
    waiting = [threading.Thread(target=step, args=(finish,)) for finish in (3.0, 1.0, 2.0)]
    for thread in waiting:
        thread.start()
    deadline = time.monotonic() + 10
    while len(core._waiting) < 3 and time.monotonic() < deadline:  # all three queued behind the held turn
        time.sleep(0.01)
    release.set()
    for thread in [first, *waiting]:
        thread.join(timeout=10)
    assert order == [5.0, 1.0, 2.0, 3.0]
    assert overlapped == []


def test_backlog_counts_the_other_members_only():
    core = SharedCore()
    me, other, third = _Member(100.0), _Member(0.5), _Member(0.25)
    for member in (me, other, third):
        core.join(member)
    assert core.backlog_s(me, before=7.0) == 0.75
    assert me.asked == [] and other.asked == [7.0] and third.asked == [7.0]
    core.leave(third)
    assert core.backlog_s(me, before=7.0) == 0.5


def _params(steps: int, seed: int) -> GenerationParams:
    return GenerationParams(prompt="a red circle", width=64, height=64, num_inference_steps=steps,
                            guidance_scale=7.5, seed=seed)


@pytest.fixture
def two_engines() -> list[DiffusionEngine]:
    return [DiffusionEngine.from_config(DiffusionModelConfig(name=name, preset="tiny", weights="seeded", seed=seed,
                                                             device="cpu"))
            for seed, name in enumerate(("a", "b"))]


def _loops(engines: list[DiffusionEngine], core: SharedCore | None, steps: list[tuple[str, int]]):
    """Loop "a" holds its 40-step request after its second step (inside its turn); both record their steps."""
    reached, release = threading.Event(), threading.Event()

    def on_step_a(state):
        steps.append(("a", state.step_index))
        if state.params.num_inference_steps == 40 and state.step_index == 2:
            reached.set()
            release.wait(timeout=60)

    config = EngineConfig(admission_wait_fraction=0.25)
    a = EngineLoop(engines[0], config, on_step=on_step_a, core=core)
    b = EngineLoop(engines[1], config, on_step=lambda state: steps.append(("b", state.step_index)), core=core)
    return a, b, reached, release


def test_on_a_shared_core_a_loop_refuses_what_the_other_loops_work_delays_and_steps_only_at_its_turn(two_engines):
    steps: list[tuple[str, int]] = []
    a, b, reached, release = _loops(two_engines, SharedCore(), steps)
    try:
        b.submit(_params(2, seed=0)).result(timeout=60)  # a step time of its own, then idle
        long = a.submit(_params(40, seed=1))
        assert reached.wait(timeout=60)
        with pytest.raises(EngineOverloaded) as refused:
            b.submit(_params(8, seed=2))  # idle itself, but 38 steps of "a" would run first
        assert refused.value.wait_steps > 2 and refused.value.wait_s > 0
        b.config = EngineConfig(admission_wait_fraction=None)
        admitted = b.submit(_params(8, seed=3))
        time.sleep(0.5)
        assert steps[-1] == ("a", 2)  # "b" did not step while "a" held the core
        release.set()
        assert len(long.result(timeout=120).images) == 1
        assert len(admitted.result(timeout=120).images) == 1
    finally:
        release.set()
        a.stop()
        b.stop()
    after = steps[steps.index(("a", 2)) + 1:]
    # "a"'s request would finish first alone, so it keeps every turn until it is done; then "b" runs its 8
    assert after == [("a", index) for index in range(3, 41)] + [("b", index) for index in range(1, 9)]


def test_without_a_shared_core_the_other_loop_admits_and_steps_meanwhile(two_engines):
    steps: list[tuple[str, int]] = []
    a, b, reached, release = _loops(two_engines, None, steps)
    try:
        b.submit(_params(2, seed=0)).result(timeout=60)
        long = a.submit(_params(40, seed=1))
        assert reached.wait(timeout=60)
        assert len(b.submit(_params(8, seed=2)).result(timeout=120).images) == 1  # done while "a" is held
        assert steps[-1] == ("b", 8) and not long.done()
        release.set()
        long.result(timeout=120)
    finally:
        release.set()
        a.stop()
        b.stop()
