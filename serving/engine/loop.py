"""The engine loop: step-level (continuous) batching of requests in one thread.

At every step boundary the loop admits new requests, applies LoRAs whose loads finished, and runs one UNet step
for the oldest runnable request with every other runnable one of the same image size (up to ``max_batch_rows``
rows). A request whose LoRA is still loading denoises without it until its deadline step, then waits there.
A request that would wait too long for its first step is refused at submission (``serving.engine.admission``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from serving.common.errors import RequestItemError
from serving.common.logging import get_logger
from serving.common.metrics import NO_METRICS, Metrics
from serving.config import EngineConfig
from serving.controlnet.client import ControlNetUnavailable
from serving.engine.admission import EngineOverloaded, Work, wait_steps
from serving.engine.denoiser import DiffusionEngine, encode_png
from serving.engine.request import PendingLoRA, RequestState
from serving.engine.types import GenerationParams, GenerationResult, LoRAReport
from serving.lora.cache import LoRACache
from serving.lora.registry import LoRANotFound

logger = get_logger("engine.loop")

StepCallback = Callable[[RequestState], None]


class LoRALoadFailed(RequestItemError):
    """A request's LoRA file failed to load or to validate: 422."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(422, f"LoRA {name!r} could not be loaded: {cause}", field="loras", name=name,
                         code="lora_load_failed")


@dataclass
class _Submission:
    params: GenerationParams
    loras: list[PendingLoRA]
    future: Future[GenerationResult]
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class _Active:
    submission: _Submission
    state: RequestState


class EngineLoop:
    """Runs ``engine`` in a background thread; ``submit`` is thread-safe and returns a future."""

    def __init__(self, engine: DiffusionEngine, config: EngineConfig, lora_cache: LoRACache | None = None,
                 *, on_step: StepCallback | None = None, metrics: Metrics = NO_METRICS) -> None:
        self.engine = engine
        self.config = config
        self.lora_cache = lora_cache
        self._on_step = on_step
        self._metrics = metrics
        self._queue: deque[_Submission] = deque()
        self._active: list[_Active] = []
        self._step_s: float | None = None  # moving average of one step's wall time
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="diffusion-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, params: GenerationParams) -> Future[GenerationResult]:
        """Queue a request. LoRA name errors (invalid, unknown) and ``EngineOverloaded`` raise here, before any
        work starts."""
        self.engine.validate(params)
        self._check_admission(params)
        loras = [self._request_lora(spec.name, spec.scale) for spec in params.loras]
        submission = _Submission(params, loras, Future())
        for pending in loras:
            pending.load.add_done_callback(lambda _: self._notify())
        with self._wakeup:
            if self._stopping:
                raise RuntimeError("engine loop is stopped")
            self._queue.append(submission)
            self._wakeup.notify()
        return submission.future

    def _check_admission(self, params: GenerationParams) -> None:
        fraction = self.config.admission_wait_fraction
        if fraction is None:
            return
        with self._wakeup:
            queued = [Work(s.params.rows, s.params.num_inference_steps) for s in self._queue]
        running = [Work(active.state.rows, active.state.steps_left) for active in list(self._active)]
        waited = wait_steps(running, queued, Work(params.rows, params.num_inference_steps),
                            self.config.max_batch_rows, self.config.continuous_batching)
        allowed = fraction * params.num_inference_steps
        if waited > allowed:
            raise EngineOverloaded(waited, allowed, waited * (self._step_s or 0.0))

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()

    # -- loop thread ------------------------------------------------------------------------------

    def _request_lora(self, name: str, scale: float) -> PendingLoRA:
        if self.lora_cache is None:
            raise LoRANotFound(name)
        hit = self.lora_cache.contains(name)
        return PendingLoRA(name=name, scale=scale, load=self.lora_cache.get(name), cache_hit=hit)

    def _notify(self) -> None:
        with self._wakeup:
            self._wakeup.notify()

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._stopping or self._admissible() or self._runnable() or self._loras_ready()):
                    self._wakeup.wait()
                if self._stopping:
                    break
                admitted = self._take_admissible()
            for submission in admitted:
                self._admit(submission)
            self._apply_finished_loras()
            batch = self._next_batch()
            if batch:
                self._step(batch)
        stopped = RuntimeError("engine loop stopped")
        for submission in [*self._queue, *(active.submission for active in self._active)]:
            _fail(submission.future, stopped)

    def _admissible(self) -> bool:
        """Queued requests may join now: at any step boundary, or only when idle without continuous batching."""
        return bool(self._queue) and (self.config.continuous_batching or not self._active)

    def _take_admissible(self) -> list[_Submission]:
        if not self._admissible():
            return []
        admitted = list(self._queue)
        self._queue.clear()
        return admitted

    def _admit(self, submission: _Submission) -> None:
        if submission.future.cancelled():
            return
        try:
            state = self.engine.start(submission.params, submission.loras, self.config.lora_wait_fraction)
        except Exception as exc:  # bad request that slipped through validation: fail it alone
            _fail(submission.future, exc)
            return
        self._active.append(_Active(submission, state))

    def _apply_finished_loras(self) -> None:
        now = time.perf_counter()
        for active in list(self._active):
            state = active.state
            if not state.loras_pending:
                continue
            if state.blocked and state.blocked_since is None:
                state.blocked_since = now
            if not state.loras_loaded:
                continue
            failed = next((p for p in state.loras if p.load.exception() is not None), None)
            if failed is not None:
                self._finish(active, error=LoRALoadFailed(failed.name, failed.load.exception()))
                continue
            try:
                self.engine.activate_loras(state)
            except Exception as exc:  # e.g. a LoRA whose targets the model cannot hook: fail that request alone
                logger.exception("applying LoRAs failed")
                self._finish(active, error=exc)
                continue
            if state.blocked_since is not None:
                state.lora_wait_s += now - state.blocked_since
                state.blocked_since = None
            self._metrics.lora_wait_steps(state.lora_applied_at)

    def _loras_ready(self) -> bool:
        return any(active.state.loras_pending and active.state.loras_loaded for active in self._active)

    def _runnable(self) -> list[_Active]:
        return [active for active in self._active if not active.state.blocked]

    def _next_batch(self) -> list[_Active]:
        for active in list(self._active):
            if active.submission.future.cancelled():
                self._active.remove(active)
        runnable = self._runnable()
        if not runnable:
            return []
        size = runnable[0].state.size
        batch, rows = [], 0
        for active in runnable:
            if active.state.size != size:
                continue
            if batch and rows + active.state.rows > self.config.max_batch_rows:
                break
            batch.append(active)
            rows += active.state.rows
        return batch

    def _step(self, batch: list[_Active]) -> None:
        started = time.perf_counter()
        try:
            self.engine.step([active.state for active in batch])
        except ControlNetUnavailable as exc:  # fail its users; the others step again (states are unchanged)
            users = [a for a in batch if any(name == exc.name for name, _, _ in a.state.controls)]
            logger.warning("%s; failing %d request(s)", exc, len(users))
            for active in users:
                self._finish(active, error=exc)
            rest = [active for active in batch if active not in users]
            if rest and users:
                self._step(rest)
            return
        except Exception as exc:
            logger.exception("denoising step failed for %d request(s)", len(batch))
            for active in batch:
                self._finish(active, error=exc)
            return
        took = time.perf_counter() - started
        self._step_s = took if self._step_s is None else 0.9 * self._step_s + 0.1 * took
        self._metrics.diffusion_step(took, rows=sum(active.state.rows for active in batch))
        for active in batch:
            if self._on_step is not None:
                self._on_step(active.state)
            if active.state.done:
                self._finish(active)
            elif active.state.blocked and not active.state.loras_loaded:  # at its LoRA deadline: it waits from now
                active.state.blocked_since = time.perf_counter()

    def _finish(self, active: _Active, error: BaseException | None = None) -> None:
        self._active.remove(active)
        future = active.submission.future
        if error is not None:
            _fail(future, error)
            return
        try:
            decode_started = time.perf_counter()
            images = [encode_png(image) for image in self.engine.decode(active.state)]
        except Exception as exc:
            logger.exception("decoding failed")
            _fail(future, exc)
            return
        finished = time.perf_counter()
        state, submission = active.state, active.submission
        report = None
        if state.loras:
            report = LoRAReport(
                names=tuple(p.name for p in state.loras),
                mode=state.params.lora_mode,
                cache_hits=sum(p.cache_hit for p in state.loras),
                applied_at_step=state.lora_applied_at,
                wait_s=state.lora_wait_s,
            )
        result = GenerationResult(
            images=images,
            seed=state.params.seed,
            timings={
                "queue_s": state.admitted - submission.submitted,
                "denoise_s": decode_started - state.admitted,
                "decode_s": finished - decode_started,
            },
            lora=report,
        )
        if not future.cancelled():
            future.set_result(result)


def _fail(future: Future, error: BaseException) -> None:
    if not future.cancelled() and not future.done():
        future.set_exception(error)
