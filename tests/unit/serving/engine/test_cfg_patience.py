"""How long an engine relies on its CFG worker (``WorkerPatience``): a late worker's rows are computed here, and a
failing worker is left alone for a pause that grows with each failure in a row."""

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from serving.common.metrics import CFG_LOCAL_FALLBACKS, InMemorySink, Metrics
from serving.config import CFGWorkerConfig
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.cfg import LocalCFGWorker, WorkerPatience
from serving.presets import build_preset
from tests.helpers.clock import ManualClock
from tests.helpers.denoising import denoise_together

CPU = torch.device("cpu")
TOLERANCE = 1e-3


def test_the_wait_is_the_engines_own_time_times_the_patience_and_never_below_the_floor():
    patience = WorkerPatience(patience=4.0, min_wait_s=0.5)
    assert patience.wait_s(0.01) == 0.5
    assert patience.wait_s(0.5) == 2.0


def test_each_failure_in_a_row_doubles_the_pause_up_to_the_cap_and_an_answer_resets_it():
    clock = ManualClock()
    patience = WorkerPatience(retry_after_s=1.0, max_retry_after_s=3.0, clock=clock)
    assert patience.available()
    assert [patience.failed() for _ in range(4)] == [1.0, 2.0, 3.0, 3.0]
    assert not patience.available()
    clock.now += 2.9
    assert not patience.available()
    clock.now += 0.1
    assert patience.available()
    patience.answered()
    assert patience.failed() == 1.0


@pytest.mark.parametrize("kwargs", [{"patience": 0}, {"min_wait_s": -1}, {"retry_after_s": 0},
                                    {"retry_after_s": 2.0, "max_retry_after_s": 1.0}])
def test_bad_patience_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        WorkerPatience(**kwargs)


def test_the_config_refuses_a_cap_below_the_first_pause():
    with pytest.raises(ValueError, match="max_retry_after_s"):
        CFGWorkerConfig(retry_after_s=5.0, max_retry_after_s=1.0)


class Silent(LocalCFGWorker):
    """A worker whose calls are never answered (a dead replica's calls queued for its replacement); it records them."""

    def __init__(self, engine: DiffusionEngine) -> None:
        super().__init__(engine)
        self.calls: list[Future] = []

    def submit(self, batch):
        pending: Future = Future()
        self.calls.append(pending)
        return pending


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle", width=64, height=64, num_inference_steps=4, guidance_scale=7.5, seed=5)
    return GenerationParams(**{**values, **overrides})


def test_a_worker_that_never_answers_costs_one_bounded_wait_then_is_left_alone_until_the_pause_ends():
    clock = ManualClock()
    sink = InMemorySink()
    worker = Silent(DiffusionEngine("tiny", build_preset("tiny"), CPU))
    patience = WorkerPatience(patience=1.0, min_wait_s=0.05, retry_after_s=10.0, clock=clock)
    engine = DiffusionEngine("tiny", build_preset("tiny"), CPU, cfg_worker=worker, cfg_patience=patience,
                             metrics=Metrics(sink))
    request = _params()
    try:
        images = denoise_together(engine, [(request, [])])
        assert len(worker.calls) == 1  # the first step waited and gave up; the clock stood still: no other call
        assert worker.calls[0].cancelled()
        assert sink.total(CFG_LOCAL_FALLBACKS) == request.num_inference_steps
        clock.now += 10.0
        denoise_together(engine, [(_params(seed=6), [])])
        assert len(worker.calls) == 2  # the pause over, the worker is called again
    finally:
        worker.close()
    expected = denoise_together(DiffusionEngine("tiny", build_preset("tiny"), CPU), [(request, [])])
    assert np.abs(images[0] - expected[0]).max() <= TOLERANCE
