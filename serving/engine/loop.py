"""The engine loop: step-level (continuous) batching of requests in one thread, with a stage thread beside it.

The loop thread only denoises. At every step boundary it admits requests whose preparation finished, applies
LoRAs made ready, and runs one denoiser step for the requests ``serving.engine.scheduling`` picks. The stage thread
does the rest, so the loop never waits on it: text encoding and initial noise (``DiffusionEngine.start``), LoRA
device copies and text re-encoding (``prepare_loras``), VAE decoding and PNG encoding of finished requests, and the
previews a request asks for (``partial_images``: the loop thread only copies the latents at the steps
``serving.engine.preview.preview_steps`` picks; the stage thread decodes them and calls the request's callback).
A request whose LoRA is still loading denoises without it until its deadline step, then waits there.
A request that would wait too long for its first step is refused at submission (``serving.engine.admission``).
Loops of models in one replica share its device (``serving.engine.shared_core``): a step runs at its turn, and
admission counts the other loops' work that goes first.
A request whose future is cancelled is dropped where it is: still queued, its preparation is cancelled if not begun;
denoising, its rows are freed at the next step boundary; denoised, its decode is skipped. Either way its LoRA loads
that no other request waits for are dropped while still queued (``LoRACache.release``), and it is counted
(``Metrics.request_cancelled``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from serving.common.errors import RequestItemError
from serving.common.logging import get_logger
from serving.common.metrics import NO_METRICS, CancelStage, Metrics
from serving.config import EngineConfig
from serving.controlnet.client import ControlNetUnavailable
from serving.engine.admission import EngineOverloaded, Work, steps_to_finish, wait_steps
from serving.engine.diffusion_engine import DiffusionEngine, encode_png
from serving.engine.preview import PreviewDecoder, PreviewKind, preview_decoder, preview_steps
from serving.engine.request import PendingLoRA, RequestState
from serving.engine.scheduling import Slot, pick_batch, record_steps
from serving.engine.shared_core import CoreMember, SharedCore
from serving.engine.types import GenerationParams, GenerationResult, LoRAReport, PartialImage
from serving.lora.cache import LoRACache
from serving.lora.registry import LoRANotFound

logger = get_logger("engine.loop")

StepCallback = Callable[[RequestState], None]
#: Called on the stage thread with each preview of a request, in order; it must not block.
PreviewCallback = Callable[[PartialImage], None]


class LoRALoadFailed(RequestItemError):
    """A request's LoRA file failed to load or to validate: 422."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(422, f"LoRA {name!r} could not be loaded: {cause}", field="loras", name=name,
                         code="lora_load_failed")


@dataclass(eq=False)
class _Submission:
    params: GenerationParams
    loras: list[PendingLoRA]
    future: Future[GenerationResult]
    prepared: Future[RequestState]  # the stage thread's ``engine.start``
    work: Work  # as the admission replay sees it before it starts
    ideal_finish: float  # submission plus its steps at its fastest step time: its turn on a shared core
    on_preview: PreviewCallback | None = None
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Active:
    submission: _Submission
    state: RequestState
    slot: Slot
    previews: dict[int, int] = field(default_factory=dict)  # step after which to take a preview -> its index


class EngineLoop(CoreMember):
    """Runs ``engine`` in a background thread; ``submit`` is thread-safe and returns a future. With ``core``, its
    steps take turns with the other loops on that device."""

    def __init__(self, engine: DiffusionEngine, config: EngineConfig, lora_cache: LoRACache | None = None,
                 *, on_step: StepCallback | None = None, metrics: Metrics = NO_METRICS,
                 preview: PreviewKind = "approx", core: SharedCore | None = None) -> None:
        self.engine = engine
        self.config = config
        self.lora_cache = lora_cache
        self._on_step = on_step
        self._metrics = metrics
        self._preview_kind = preview
        self._preview_decoder: PreviewDecoder | None = None  # made on the stage thread at the first preview
        self._queue: deque[_Submission] = deque()
        self._active: list[_Active] = []
        self._step_s: float | None = None  # moving average of one step's wall time
        self._fastest_step_s: dict[int, float] = {}  # batch rows -> the fastest step seen with that many
        #: seconds spent computing denoising steps since the start, time blocked on remote results (ControlNet
        #: services, the CFG worker) left out (benchmarks read it)
        self.busy_s = 0.0
        self._wakeup = threading.Condition()
        self._stopping = False
        self._core = core
        if core is not None:
            core.join(self)
        self._stage = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion-stage")
        self._thread = threading.Thread(target=self._run, name="diffusion-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, params: GenerationParams,
               on_preview: PreviewCallback | None = None) -> Future[GenerationResult]:
        """Queue a request; ``on_preview`` gets its previews (``params.partial_images`` per image), all before the
        future's result. Cancelling the future cancels the request. LoRA name errors (invalid, unknown) and
        ``EngineOverloaded`` raise here, before any work starts."""
        self.engine.validate(params)
        work = Work(params.rows, self.engine.denoising_steps(params), (params.height, params.width))
        submitted = time.perf_counter()
        ideal_finish = submitted + work.steps_left * (self._alone_step_s(work.rows) or self._step_s or 0.0)
        self._check_admission(work, ideal_finish)
        loras = [self._request_lora(spec.name, spec.scale) for spec in params.loras]
        if loras and self.engine.cfg_worker is not None:  # the worker loads them while this replica does
            self.engine.cfg_worker.prefetch([pending.name for pending in loras])
        for pending in loras:
            pending.load.add_done_callback(lambda _: self._notify())
        with self._wakeup:
            if self._stopping:
                raise RuntimeError("engine loop is stopped")
            submission = _Submission(params, loras, Future(), self._stage.submit(self._start, params, loras), work,
                                     ideal_finish, on_preview if params.partial_images > 0 else None, submitted)
            submission.prepared.add_done_callback(lambda _: self._notify())
            self._queue.append(submission)
            self._wakeup.notify()
        submission.future.add_done_callback(lambda future: self._on_cancel(submission) if future.cancelled() else None)
        return submission.future

    def _on_cancel(self, submission: _Submission) -> None:
        """On the cancelling thread: a queued request is dropped now; the loop thread drops an admitted one."""
        with self._wakeup:
            queued = submission in self._queue
            if queued:
                self._queue.remove(submission)
            self._wakeup.notify()
        if queued:
            submission.prepared.cancel()
            self._dropped(submission, "queued")

    def _dropped(self, submission: _Submission, stage: CancelStage) -> None:
        """Releases a cancelled request's LoRA loads, then counts it."""
        if self.lora_cache is not None:
            for pending in submission.loras:
                self.lora_cache.release(pending.name, pending.load)
        self._metrics.request_cancelled(stage)

    def _check_admission(self, work: Work, ideal_finish: float) -> None:
        fraction, slowdown = self.config.admission_wait_fraction, self.config.admission_max_slowdown
        if fraction is None and slowdown is None:
            return
        running, queued = self._work(before=math.inf)
        waited = wait_steps(running, queued, work, self.config.max_batch_rows,
                            self.config.continuous_batching, self.config.max_skipped_steps)
        step_s = self._step_s or 0.0
        ahead_s = self._core.backlog_s(self, ideal_finish) if self._core is not None else 0.0
        wait = waited + (ahead_s / step_s if step_s > 0 else 0.0)  # in this loop's steps
        if fraction is not None and wait > fraction * work.steps_left:
            raise EngineOverloaded.waiting(round(wait), fraction * work.steps_left, wait * step_s)
        if slowdown is None or not (running or queued or ahead_s):
            return  # off, or idle: the moving average is stale
        alone = self._alone_step_s(work.rows)
        if alone is None:
            return  # no batch as large seen yet: nothing to compare with
        predicted, limit = (wait + work.steps_left) * step_s, slowdown * work.steps_left * alone
        if predicted > limit:
            raise EngineOverloaded.slowed(predicted, work.steps_left * alone, slowdown, round(wait), wait * step_s)

    def _work(self, before: float) -> tuple[list[Work], list[Work]]:
        """The running and the queued requests whose ideal finish is earlier than ``before``, oldest first."""
        with self._wakeup:
            queued = [s.work for s in self._queue if s.ideal_finish < before]
        running = [Work(active.state.rows, active.state.steps_left, active.state.batch_key, active.slot.skipped)
                   for active in list(self._active) if active.submission.ideal_finish < before]
        return running, queued

    def backlog_s(self, before: float) -> float:
        """Seconds of denoising left for this loop's requests whose ideal finish is earlier than ``before``, at its
        current step time (any thread)."""
        running, queued = self._work(before)
        if not (queued or running):
            return 0.0
        steps = steps_to_finish([*running, *queued], self.config.max_batch_rows, self.config.max_skipped_steps)
        return steps * (self._step_s or 0.0)

    def _alone_step_s(self, rows: int) -> float | None:
        """The fastest step seen with at least ``rows`` rows (a larger batch is no faster): a request's step time
        alone, or None before any."""
        return min((seconds for seen, seconds in list(self._fastest_step_s.items()) if seen >= rows), default=None)

    def stop(self) -> None:
        """Fails every request not finished denoising; those being decoded complete."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()
        self._stage.shutdown()
        if self._core is not None:
            self._core.leave(self)

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
                while not (self._stopping or self._admissible() or self._runnable() or self._loras_ready()
                           or self._cancelled()):
                    self._wakeup.wait()
                if self._stopping:
                    break
                admitted = self._take_admissible()
            for submission in admitted:
                self._admit(submission)
            for active in self._cancelled():
                self._active.remove(active)
                self._dropped(active.submission, "denoising")
            self._apply_finished_loras()
            batch = self._next_batch()
            if batch and self._core is None:
                self._step(batch)
            elif batch:
                with self._core.turn(min(active.submission.ideal_finish for active in batch)):
                    self._step(batch)
        stopped = RuntimeError("engine loop stopped")
        for submission in [*self._queue, *(active.submission for active in self._active)]:
            _fail(submission.future, stopped)

    def _admissible(self) -> bool:
        """Prepared requests may join now: at any step boundary, or only when idle without continuous batching."""
        return (any(s.prepared.done() for s in self._queue)
                and (self.config.continuous_batching or not self._active))

    def _take_admissible(self) -> list[_Submission]:
        if not self._admissible():
            return []
        admitted = [s for s in self._queue if s.prepared.done()]
        for submission in admitted:
            self._queue.remove(submission)
        return admitted

    def _cancelled(self) -> list[_Active]:
        return [active for active in self._active if active.submission.future.cancelled()]

    def _admit(self, submission: _Submission) -> None:
        if submission.future.cancelled():  # cancelled as it left the queue
            self._dropped(submission, "queued")
            return
        error = submission.prepared.exception()
        if error is not None:  # bad request that slipped through validation: fail it alone
            _fail(submission.future, error)
            return
        state = submission.prepared.result()
        state.admitted = time.perf_counter()
        previews = preview_steps(len(state.timesteps), state.params.partial_images) if submission.on_preview else []
        active = _Active(submission, state, Slot(state.rows, state.batch_key),
                         {step: index for index, step in enumerate(previews)})
        self._active.append(active)
        for pending in state.loras:
            pending.load.add_done_callback(lambda _, active=active: self._prepare_loras(active))

    def _start(self, params: GenerationParams, loras: list[PendingLoRA]) -> RequestState:
        """On the stage thread: the request's state, with its LoRAs prepared already when they are in memory."""
        state = self.engine.start(params, loras, self.config.lora_wait_fraction)
        if state.loras_ready_to_prepare:
            state.lora_activation = Future()
            state.lora_activation.set_result(self.engine.prepare_loras(state))
        return state

    def _prepare_loras(self, active: _Active) -> None:
        """Once every LoRA of the request has loaded, hands their preparation to the stage thread (at most once;
        never for a cancelled request)."""
        state = active.state
        if not state.loras_ready_to_prepare or active.submission.future.cancelled():
            return
        with self._wakeup:
            if state.lora_activation is not None or self._stopping:
                return
            state.lora_activation = self._stage.submit(self.engine.prepare_loras, state)
        state.lora_activation.add_done_callback(lambda _: self._notify())

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
            failed = state.failed_lora
            if failed is not None:
                self._finish(active, error=LoRALoadFailed(failed.name, failed.load.exception()))
                continue
            if state.lora_activation is None or not state.lora_activation.done():
                continue
            try:
                self.engine.apply_loras(state, state.lora_activation.result())
            except Exception as exc:  # e.g. a LoRA whose targets the model cannot hook: fail that request alone
                logger.exception("applying LoRAs failed")
                self._finish(active, error=exc)
                continue
            if state.blocked_since is not None:
                state.lora_wait_s += now - state.blocked_since
                state.blocked_since = None
            self._metrics.lora_wait_steps(state.lora_applied_at)

    def _loras_ready(self) -> bool:
        """A request has LoRA work for the loop: a load failed, or its LoRAs are prepared."""
        return any(active.state.loras_pending and active.state.loras_loaded
                   and (active.state.lora_activation is None or active.state.lora_activation.done())
                   for active in self._active)

    def _runnable(self) -> list[_Active]:
        return [active for active in self._active if not active.state.blocked]

    def _next_batch(self) -> list[_Active]:
        runnable = self._runnable()
        slots = [active.slot for active in runnable]
        batch = pick_batch(slots, self.config.max_batch_rows, self.config.max_skipped_steps)
        record_steps(slots, batch)
        return [runnable[i] for i in batch]

    def _step(self, batch: list[_Active]) -> None:
        started, waited = time.perf_counter(), self.engine.remote_wait_s
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
        rows = sum(active.state.rows for active in batch)
        self._fastest_step_s[rows] = min(took, self._fastest_step_s.get(rows, took))
        self.busy_s += took - (self.engine.remote_wait_s - waited)
        self._metrics.diffusion_step(took, rows=rows)
        for active in batch:
            if self._on_step is not None:
                self._on_step(active.state)
            self._take_preview(active)
            if active.state.done:
                active.state.denoised = time.perf_counter()
                self._finish(active)
            elif active.state.blocked:  # at its LoRA deadline without its LoRAs applied: it waits from now
                active.state.blocked_since = time.perf_counter()

    def _take_preview(self, active: _Active) -> None:
        """After a step the request wants a preview of: copies its latents for the stage thread to decode."""
        partial_index = active.previews.get(active.state.step_index)
        if partial_index is None or active.submission.future.cancelled():
            return
        latents = active.state.preview_latents.detach().clone()
        self._stage.submit(self._preview, active.submission, latents, active.state.step_index, partial_index)

    def _preview(self, submission: _Submission, latents: torch.Tensor, step: int, partial_index: int) -> None:
        """On the stage thread: decode a preview of every image of the request and hand each to its callback. A
        preview that fails is logged and left out; the request goes on."""
        if submission.future.done() or submission.on_preview is None:
            return
        try:
            images = self._previews().decode(latents, submission.params.height, submission.params.width)
            for image_index, image in enumerate(images):
                submission.on_preview(PartialImage(image_index, partial_index, step, encode_png(image)))
        except Exception:
            logger.exception("preview after step %d failed", step)

    def _previews(self) -> PreviewDecoder:
        """On the stage thread: the preview decoder, made (``approx``: fitted) at the first preview."""
        if self._preview_decoder is None:
            engine = self.engine
            self._preview_decoder = preview_decoder(self._preview_kind, engine.vae, engine.vae_scale_factor,
                                                    engine.vae_dtype)
        return self._preview_decoder

    def _finish(self, active: _Active, error: BaseException | None = None) -> None:
        self._active.remove(active)
        if error is not None:
            _fail(active.submission.future, error)
            return
        self._stage.submit(self._deliver, active)

    def _deliver(self, active: _Active) -> None:
        """On the stage thread: decode the finished request's images and answer it."""
        state, submission = active.state, active.submission
        if submission.future.cancelled():
            self._dropped(submission, "decoding")
            return
        try:
            decode_started = time.perf_counter()
            images = [encode_png(image) for image in self.engine.decode(state)]
        except Exception as exc:
            logger.exception("decoding failed")
            _fail(submission.future, exc)
            return
        finished = time.perf_counter()
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
                "denoise_s": state.denoised - state.admitted,
                "decode_s": finished - decode_started,
            },
            lora=report,
        )
        if not _resolve(submission.future, result):  # cancelled while it decoded
            self._dropped(submission, "decoding")


def _resolve(future: Future, result: GenerationResult) -> bool:
    """Sets the result unless the future was cancelled meanwhile (False then)."""
    try:
        future.set_result(result)
    except InvalidStateError:
        return False
    return True


def _fail(future: Future, error: BaseException) -> None:
    if not future.cancelled() and not future.done():
        future.set_exception(error)
