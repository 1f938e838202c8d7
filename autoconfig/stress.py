"""Open-loop stress client: the highest request rate an HTTP endpoint sustains under a p99 latency SLO.

Requests leave on a seeded schedule whether or not earlier ones were answered, and latency counts from each
request's *scheduled* send time; timeouts, transport errors and non-2xx answers are errors. The rate search
doubles the rate until the SLO breaks, then bisects (docs/AUTOCONFIG.md, "The rate search").
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Literal

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from autoconfig.workloads import Workload

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
    probe_s: float = Field(5.0, gt=0, description="Duration of one probe's schedule.")
    max_error_rate: float = Field(0.01, ge=0, le=1, description="More errors than this: not sustainable.")
    rel_tolerance: float = Field(0.1, gt=0, description="Bisection stops when (bad - good) / good is at most this.")
    max_probes: int = Field(16, ge=1, description="Most probes in one search.")
    max_total_s: float = Field(300.0, gt=0, description="No probe starts that would end after this many seconds.")
    max_rps: float = Field(100_000.0, gt=0, description="Rates are never raised beyond this.")


class LoadResult(BaseModel):
    """One probe: ``rate`` requests/s offered for ``duration_s``; latencies of the 2xx answers and, when the probe
    ``stopped_early`` (the SLO already broken), of the ``cancelled`` requests as the time they had waited."""

    rate: float
    duration_s: float
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
    """A measurement taken by the rate search and whether it met the SLO."""

    result: LoadResult
    sustainable: bool


class RateSearchResult(BaseModel):
    """The highest sustainable rate found (0: not even ``start_rps``) and every probe, in order."""

    slo_p99_ms: float
    sustainable_rps: float
    best: LoadResult | None
    probes: list[Probe]
    stop_reason: StopReason
    duration_s: float


def arrival_offsets(rate: float, duration_s: float, arrivals: Arrivals, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start, sorted, within ``[0, duration_s)``; at least one."""
    if arrivals == "constant":
        return np.arange(max(1, round(rate * duration_s))) / rate
    count = max(1, int(rng.poisson(rate * duration_s)))
    return np.sort(rng.uniform(0.0, duration_s, count))


def is_sustainable(result: LoadResult, slo_p99_ms: float, max_error_rate: float) -> bool:
    """Something completed, errors within bounds, and p99 within the SLO."""
    return result.p99_ms is not None and result.p99_ms <= slo_p99_ms and result.error_rate <= max_error_rate


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
        workload: Workload,
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

    async def measure(self, rate: float, duration_s: float, *, slo_p99_ms: float | None = None) -> LoadResult:
        """Offer ``rate`` requests/s for ``duration_s`` seconds, then wait for every answer (or its timeout).

        With ``slo_p99_ms``, the probe stops as soon as more than 1% of its planned requests are late (answered,
        or still unanswered, past ``scheduled + slo_p99_ms``): their p99 is then above the SLO whatever happens
        next, so sending stops and the open requests are cancelled instead of drained. Each cancelled request
        counts with the time it had waited (a lower bound of its latency), ``stopped_early`` is set.
        ``achieved_rps`` is the 2xx answers over the window or, if the last answer came later, until it came.
        """
        if rate <= 0 or duration_s <= 0:
            raise ValueError(f"rate and duration_s must be > 0, got {rate} and {duration_s}")
        loop = asyncio.get_running_loop()
        offsets = arrival_offsets(rate, duration_s, self.settings.arrivals, self._rng)
        late_budget = int(0.01 * len(offsets))
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
                if late > late_budget:
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
            completed=len(ok_s),
            errors=len(answered) - len(ok_s),
            cancelled=len(waited),
            p50_ms=p50,
            p99_ms=p99,
            achieved_rps=len(ok_s) / max(elapsed, duration_s),
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
            workload = self.workload
            response = await self._http.request(
                workload.method, workload.path, content=workload.body(index), headers=workload.headers
            )
            return response.status_code

    async def find_sustainable_rate(
        self,
        slo_p99_ms: float,
        settings: SearchSettings | None = None,
        *,
        on_probe: Callable[[Probe], None] | None = None,
    ) -> RateSearchResult:
        """Double the rate until the SLO breaks, then bisect; ``on_probe`` sees every probe as it finishes."""
        settings = settings or SearchSettings()
        started = time.monotonic()
        probes: list[Probe] = []

        async def probe(rate: float) -> Probe:
            measured = await self.measure(rate, settings.probe_s, slo_p99_ms=slo_p99_ms)
            taken = Probe(result=measured, sustainable=is_sustainable(measured, slo_p99_ms, settings.max_error_rate))
            probes.append(taken)
            if on_probe is not None:
                on_probe(taken)
            return taken

        def out_of_budget() -> StopReason | None:
            if len(probes) >= settings.max_probes:
                return "max_probes"
            if time.monotonic() - started + settings.probe_s > settings.max_total_s:
                return "max_time"
            return None

        good: Probe | None = None
        bad_rate: float | None = None
        rate = min(settings.start_rps, settings.max_rps)
        stop: StopReason | None = None
        while stop is None and bad_rate is None:  # doubling
            taken = await probe(rate)
            if not taken.sustainable:
                bad_rate = rate
            elif rate >= settings.max_rps:
                good, stop = taken, "max_rps"
            else:
                good, rate = taken, min(2 * rate, settings.max_rps)
                stop = out_of_budget()
        if good is None:
            stop = "unsustainable"
        while stop is None:  # bisection between good and bad_rate
            assert good is not None and bad_rate is not None
            if (bad_rate - good.result.rate) / good.result.rate <= settings.rel_tolerance:
                stop = "converged"
            elif (stop := out_of_budget()) is None:
                taken = await probe((good.result.rate + bad_rate) / 2)
                if taken.sustainable:
                    good = taken
                else:
                    bad_rate = taken.result.rate
        return RateSearchResult(
            slo_p99_ms=slo_p99_ms,
            sustainable_rps=good.result.rate if good else 0.0,
            best=good.result if good else None,
            probes=probes,
            stop_reason=stop,
            duration_s=time.monotonic() - started,
        )
