"""Open-loop stress client: the highest request rate an HTTP endpoint sustains under a p99 latency SLO.

Requests leave on a seeded schedule whether or not earlier ones were answered, and latency counts from each
request's *scheduled* send time; timeouts, transport errors and non-2xx answers are errors. The rate search
doubles the rate with short scouting probes until the SLO breaks, decides with probes of at least ``min_requests``
requests, bisects with scouts and decides the bracket they leave (docs/AUTOCONFIG.md, "The rate search").
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from typing import Literal

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from autoconfig.workloads import RequestSource

Arrivals = Literal["constant", "poisson"]
StopReason = Literal["converged", "max_rps", "max_probes", "max_time", "unsustainable"]


class ClientSettings(BaseModel):
    """How the client sends requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrivals: Arrivals = Field("poisson", description="Inter-arrival times: `constant` or exponential (`poisson`).")
    seed: int = Field(0, description="Seed of the Poisson arrival schedule.")
    timeout_s: float = Field(10.0, gt=0, description="A request not answered this long after its scheduled time fails.")
    max_in_flight: int = Field(256, ge=1, description="Most requests open at once.")


class SearchSettings(BaseModel):
    """How ``find_sustainable_rate`` searches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_rps: float = Field(1.0, gt=0, description="First rate probed; doubled while sustainable.")
    probe_s: float = Field(
        1.0, gt=0, description="Length of a scouting probe (the doubling), and the shortest deciding probe."
    )
    min_requests: int = Field(
        200, ge=1, le=1_000_000, description="Requests of a deciding probe: the reported rate, and the rates "
        "found unsustainable, are measured with at least this many (at 200, the p99 is not the maximum)."
    )
    max_error_rate: float = Field(0.01, ge=0, le=1, description="More errors than this: not sustainable.")
    rel_tolerance: float = Field(
        0.025, gt=0, le=1, description="Bisection stops when (bad - good) / good is at most this."
    )
    max_probes: int = Field(24, ge=1, description="Most probes in one search.")
    max_total_s: float = Field(300.0, gt=0, description="No probe starts that would end after this many seconds.")
    max_rps: float = Field(100_000.0, gt=0, description="Rates are never raised beyond this.")

    def deciding_requests(self, rate: float) -> int:
        """Requests a deciding probe at ``rate`` plans: ``min_requests``, or more if ``probe_s`` holds more."""
        return max(self.min_requests, round(rate * self.probe_s))


class LoadResult(BaseModel):
    """One probe: ``rate`` requests/s offered for ``duration_s`` (``planned`` requests); latencies of the 2xx
    answers and, when the probe ``stopped_early`` (the SLO already broken), of the ``cancelled`` requests as the
    time they had waited."""

    rate: float
    duration_s: float
    planned: int = 0
    completed: int
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    achieved_rps: float
    cancelled: int = 0
    stopped_early: bool = False

    @property
    def error_rate(self) -> float:
        sent = self.completed + self.errors
        return self.errors / sent if sent else 0.0


class Probe(BaseModel):
    """A measurement taken by the rate search, whether it met the SLO, and whether it planned enough requests
    (``SearchSettings.min_requests``) to decide; a scout's verdict only steers the doubling."""

    result: LoadResult
    sustainable: bool
    deciding: bool = True


class RateSearchResult(BaseModel):
    """The highest rate a deciding probe found sustainable (0: none) and every probe, in order; ``best`` is that
    probe's measurement (its ``achieved_rps`` beside the offered rate)."""

    slo_p99_ms: float
    sustainable_rps: float
    best: LoadResult | None
    probes: list[Probe]
    stop_reason: StopReason
    duration_s: float


def arrival_offsets(
    rate: float, duration_s: float, arrivals: Arrivals, rng: np.random.Generator, count: int | None = None
) -> np.ndarray:
    """Send times in seconds from the start, sorted, within ``[0, duration_s)``; at least one.

    ``count`` fixes how many (a Poisson process given its count: uniform times); otherwise constant arrivals send
    ``rate * duration_s`` and Poisson ones a Poisson-distributed number.
    """
    if arrivals == "constant":
        return np.arange(max(1, round(rate * duration_s)) if count is None else count) / rate
    if count is None:
        count = max(1, int(rng.poisson(rate * duration_s)))
    return np.sort(rng.uniform(0.0, duration_s, count))


def is_sustainable(result: LoadResult, slo_p99_ms: float, max_error_rate: float) -> bool:
    """Something completed, errors within bounds, p99 within the SLO, and the probe was not stopped for breaking
    it."""
    return (
        not result.stopped_early
        and result.p99_ms is not None
        and result.p99_ms <= slo_p99_ms
        and result.error_rate <= max_error_rate
    )


def late_budget(planned: int) -> int:
    """Late requests a probe of ``planned`` may have with its p99 still possibly within the SLO: one more puts a
    late one at or above the p99's position (``numpy.percentile``'s, 0.99 (planned - 1)), so the p99 is late."""
    return planned - 1 - math.floor(0.99 * (planned - 1))


def _is_late(scheduled: float, task: asyncio.Future[float | None], now: float, slo_s: float) -> bool:
    """A request unanswered past ``scheduled + slo_s``, or answered (2xx) later than that."""
    if not task.done():
        return now - scheduled > slo_s
    latency = None if task.cancelled() else task.result()
    return latency is not None and latency > slo_s


class StressClient:
    """Drives ``workload`` against ``base_url`` (the application's route prefix); use as an async context.

    At most ``max_in_flight`` requests are open at once; one waiting for a slot stays on its clock and fails as a
    timeout at ``scheduled + timeout_s``, so a dead server cannot make the client open unbounded sockets.
    """

    def __init__(
        self,
        base_url: str,
        workload: RequestSource,
        settings: ClientSettings | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.workload = workload
        self.settings = settings or ClientSettings()
        limit = self.settings.max_in_flight
        self._http = httpx.AsyncClient(
            base_url=base_url,
            transport=transport,
            timeout=self.settings.timeout_s,
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        )
        self._slots = asyncio.Semaphore(limit)
        self._rng = np.random.default_rng(self.settings.seed)
        self._index = itertools.count()

    async def __aenter__(self) -> StressClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.aclose()

    async def measure(
        self, rate: float, duration_s: float, *, slo_p99_ms: float | None = None, requests: int | None = None
    ) -> LoadResult:
        """Offer ``rate`` requests/s for ``duration_s`` seconds, then wait for every answer (or its timeout).

        ``requests`` fixes how many are sent; the window then lasts ``max(duration_s, requests / rate)``.

        With ``slo_p99_ms``, the probe stops as soon as more than ``late_budget`` (about 1%) of its planned
        requests are late (answered, or still unanswered, past ``scheduled + slo_p99_ms``): their p99 is then
        above the SLO whatever happens next, so sending stops and the open requests are cancelled instead of
        drained. Each cancelled request counts with the time it had waited (a lower bound of its latency),
        ``stopped_early`` is set, and the probe is not sustainable.
        ``achieved_rps`` is the 2xx answers over the window or, if the last answer came later, until it came; over
        the time the probe ran when it stopped early (not over the window it planned).
        """
        if rate <= 0 or duration_s <= 0:
            raise ValueError(f"rate and duration_s must be > 0, got {rate} and {duration_s}")
        if requests is not None:
            if requests < 1:
                raise ValueError(f"requests must be >= 1, got {requests}")
            duration_s = max(duration_s, requests / rate)
        loop = asyncio.get_running_loop()
        offsets = arrival_offsets(rate, duration_s, self.settings.arrivals, self._rng, requests)
        budget = late_budget(len(offsets))
        start = loop.time()
        sent: list[tuple[float, asyncio.Future[float | None]]] = []
        broken = asyncio.Event()

        async def send() -> None:
            for offset in offsets:
                scheduled = start + float(offset)
                delay = scheduled - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent.append((scheduled, asyncio.ensure_future(self._timed_request(scheduled))))
            await asyncio.sleep(max(0.0, start + duration_s - loop.time()))  # a probe spans its whole window
            await asyncio.gather(*(task for _, task in sent))

        async def watch(slo_s: float) -> None:
            # A request's lateness is settled once its deadline (scheduled + SLO) has passed, and deadlines come
            # in send order: each request is judged once, when the watch first sees its deadline behind it.
            late = judged = 0
            while True:
                now = loop.time()
                while judged < len(sent) and now - sent[judged][0] > slo_s:
                    late += _is_late(*sent[judged], now, slo_s)
                    judged += 1
                if late > budget:
                    broken.set()
                    return
                await asyncio.sleep(0.01)

        sender = asyncio.ensure_future(send())
        watcher = asyncio.ensure_future(watch(slo_p99_ms / 1000.0)) if slo_p99_ms is not None else None
        waiting = {sender} | ({watcher} if watcher else set())
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        stopped_early = broken.is_set() and not sender.done()
        now = loop.time()
        for task in (sender, watcher):
            if task is not None and not task.done():
                task.cancel()
        answered: list[float | None] = []
        waited: list[float] = []
        for scheduled, task in sent:
            if task.done() and not task.cancelled():
                answered.append(task.result())
            else:
                task.cancel()
                waited.append(now - scheduled)  # cancelled after waiting this long: a lower bound of its latency
        await asyncio.gather(*(task for _, task in sent), return_exceptions=True)
        elapsed = loop.time() - start
        ok_s = [latency for latency in answered if latency is not None]
        timed_ms = [1000.0 * latency for latency in ok_s + waited]
        p50, p99 = np.percentile(timed_ms, [50, 99]).tolist() if timed_ms else (None, None)
        return LoadResult(
            rate=rate,
            duration_s=duration_s,
            planned=len(offsets),
            completed=len(ok_s),
            errors=len(answered) - len(ok_s),
            cancelled=len(waited),
            p50_ms=p50,
            p99_ms=p99,
            achieved_rps=len(ok_s) / (elapsed if stopped_early else max(elapsed, duration_s)),
            stopped_early=stopped_early,
        )

    async def _timed_request(self, scheduled: float) -> float | None:
        """Seconds from ``scheduled`` to a 2xx answer; None on any error."""
        loop = asyncio.get_running_loop()
        remaining = scheduled + self.settings.timeout_s - loop.time()
        try:
            status = await asyncio.wait_for(self._send(next(self._index)), timeout=max(remaining, 0.0))
        except (asyncio.TimeoutError, httpx.HTTPError):
            return None
        return loop.time() - scheduled if 200 <= status < 300 else None

    async def _send(self, index: int) -> int:
        async with self._slots:
            request = self.workload.request(index)
            response = await self._http.request(
                request.method, request.path, content=request.body, headers=request.headers
            )
            return response.status_code

    async def find_sustainable_rate(
        self,
        slo_p99_ms: float,
        settings: SearchSettings | None = None,
        *,
        on_probe: Callable[[Probe], None] | None = None,
    ) -> RateSearchResult:
        """Double the rate with scouts (``probe_s`` long) until one breaks the SLO; decide the rates at the top
        with deciding probes (``min_requests``), going down until one holds; then bisect with scouts to the
        tolerance and decide both ends of the bracket, again until the decided rates are within the tolerance.
        ``on_probe`` sees every probe as it finishes."""
        return await _RateSearch(self, slo_p99_ms, settings or SearchSettings(), on_probe).run()


class _RateSearch:
    """One ``find_sustainable_rate``: ``good`` is the highest rate a deciding probe held, ``bad_rate`` the lowest
    one a deciding probe broke; scouts only say which rates to decide."""

    def __init__(
        self,
        client: StressClient,
        slo_p99_ms: float,
        settings: SearchSettings,
        on_probe: Callable[[Probe], None] | None,
    ) -> None:
        self._client = client
        self._slo_p99_ms = slo_p99_ms
        self._settings = settings
        self._on_probe = on_probe
        self._started = time.monotonic()
        self.probes: list[Probe] = []
        self.good: Probe | None = None
        self.bad_rate: float | None = None
        self.stop: StopReason | None = None
        self._scouts_trusted = True

    async def run(self) -> RateSearchResult:
        settings = self._settings
        rate = min(settings.start_rps, settings.max_rps)
        while self.stop is None and self.bad_rate is None:
            undecided = await self._double(rate)
            await self._decide_downwards(undecided)
            if self.stop is not None or self.bad_rate is not None or self.good is None:
                break
            if self.good.result.rate >= settings.max_rps:
                self.stop = "max_rps"
            else:  # the top rate held when decided: the scout that broke was noise
                rate = min(2 * self.good.result.rate, settings.max_rps)
        if self.stop is None and self.good is None:
            self.stop = "unsustainable"
        while self.stop is None:  # between the decided good and bad_rate: bisect with scouts, decide the bracket
            assert self.good is not None and self.bad_rate is not None
            if (self.bad_rate - self.good.result.rate) / self.good.result.rate <= settings.rel_tolerance:
                self.stop = "converged"
            else:
                await self._narrow()
        good = self.good
        return RateSearchResult(
            slo_p99_ms=self._slo_p99_ms,
            sustainable_rps=good.result.rate if good else 0.0,
            best=good.result if good else None,
            probes=self.probes,
            stop_reason=self.stop,
            duration_s=time.monotonic() - self._started,
        )

    async def _double(self, rate: float) -> list[float]:
        """Scouts from ``rate``, doubling, until one breaks the SLO or passes at ``max_rps``; the rates still to
        decide, ascending (scouts that planned ``min_requests`` decided themselves)."""
        undecided: list[float] = []
        while self.stop is None:
            taken = await self._probe(rate, deciding=False)
            if taken is None:
                break
            if taken.deciding:
                self._judge(taken)
                undecided = [] if taken.sustainable else undecided
            else:
                undecided.append(rate)
            if not taken.sustainable or rate >= self._settings.max_rps:
                break
            rate = min(2 * rate, self._settings.max_rps)
        return undecided

    async def _decide_downwards(self, undecided: list[float]) -> None:
        """Deciding probes at ``undecided`` rates from the top down, until one holds."""
        for rate in reversed(undecided):
            taken = await self._probe(rate, deciding=True)
            if taken is None:
                return
            self._judge(taken)
            if taken.sustainable:
                return

    async def _narrow(self) -> None:
        """Move ``good`` up or ``bad_rate`` down. While scouts have not been contradicted: bisect between them with
        scouts to the tolerance, then decide the bracket the scouts left, its lower end (if above ``good``), then
        its upper end (if below ``bad_rate``); a deciding probe that contradicts its scout ends the trust (scouts
        of this server read the SLO otherwise than deciding probes) and the bisection goes on with deciding
        probes only."""
        assert self.good is not None and self.bad_rate is not None
        low, high = self.good.result.rate, self.bad_rate
        if not self._scouts_trusted:
            if (taken := await self._probe((low + high) / 2, deciding=True)) is not None:
                self._judge(taken)
            return
        while (high - low) / low > self._settings.rel_tolerance:
            taken = await self._probe((low + high) / 2, deciding=False)
            if taken is None:
                return
            if taken.deciding:  # long enough to decide by itself
                self._judge(taken)
            low, high = (taken.result.rate, high) if taken.sustainable else (low, taken.result.rate)
        for rate, end in ((low, self.good.result.rate), (high, self.bad_rate)):
            if rate != end:
                taken = await self._probe(rate, deciding=True)
                if taken is None:
                    return
                self._judge(taken)
                if taken.sustainable != (rate == low):
                    self._scouts_trusted = False
                    return

    def _judge(self, taken: Probe) -> None:
        rate = taken.result.rate
        if taken.sustainable:
            if self.good is None or rate > self.good.result.rate:
                self.good = taken
        elif self.bad_rate is None or rate < self.bad_rate:
            self.bad_rate = rate

    async def _probe(self, rate: float, *, deciding: bool) -> Probe | None:
        """One probe (a scout lasts ``probe_s``; a deciding one sends ``deciding_requests``), or None and ``stop``
        set when the caps leave no room for it."""
        settings = self._settings
        requests = settings.deciding_requests(rate) if deciding else None
        length_s = settings.probe_s if requests is None else max(settings.probe_s, requests / rate)
        if len(self.probes) >= settings.max_probes:
            self.stop = "max_probes"
        elif time.monotonic() - self._started + length_s > settings.max_total_s:
            self.stop = "max_time"
        if self.stop is not None:
            return None
        measured = await self._client.measure(rate, settings.probe_s, slo_p99_ms=self._slo_p99_ms, requests=requests)
        taken = Probe(
            result=measured,
            sustainable=is_sustainable(measured, self._slo_p99_ms, settings.max_error_rate),
            deciding=measured.planned >= settings.min_requests,
        )
        self.probes.append(taken)
        if self._on_probe is not None:
            self._on_probe(taken)
        return taken
