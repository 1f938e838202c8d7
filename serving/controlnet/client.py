"""How the engine reaches ControlNets: ``ControlNetClient``, and its in-process and measured implementations.

``LocalControlNets`` runs them on worker threads in this process; ``serving.deployments.controlnet`` sends the
calls to shared ControlNet deployments; ``MeasuredControlNets`` wraps either and records each call's latency.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from serving.common.errors import RequestItemError, retry_after
from serving.common.metrics import Metrics
from serving.controlnet.runner import ControlNetCall, ControlNetResiduals, ControlNetRunner


class PendingResiduals(Protocol):
    """A ControlNet call in flight: a ``Future``, or a Serve deployment's reply."""

    def result(self) -> ControlNetResiduals: ...


class ControlNetNotFound(RequestItemError):
    """No ControlNet of that name is served: 404."""

    def __init__(self, name: str) -> None:
        super().__init__(404, f"ControlNet {name!r} does not exist", field="controlnets", name=name,
                         code="controlnet_not_found")


class ControlNetUnavailable(RequestItemError):
    """A ControlNet call failed (its replica died, timed out, or raised): 503, retry."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(503, f"ControlNet {name!r} is unavailable: {type(cause).__name__}: {cause}",
                         field="controlnets", name=name, code="controlnet_unavailable", headers=retry_after(1))


class ControlNetClient(ABC):
    """The ControlNets an engine can call, wherever they run."""

    @abstractmethod
    def names(self) -> list[str]:
        """The served ControlNets, sorted."""

    @abstractmethod
    def submit(self, name: str, call: ControlNetCall) -> PendingResiduals:
        """Starts ControlNet ``name`` on ``call``; ``ControlNetNotFound`` when none has that name."""


class LocalControlNets(ControlNetClient):
    """In-process ControlNets, each call on a worker thread so they overlap the denoiser's own work (a UNet's down
    blocks)."""

    def __init__(self, runners: dict[str, ControlNetRunner], max_workers: int = 4) -> None:
        self._runners = runners
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="controlnet")

    def names(self) -> list[str]:
        return sorted(self._runners)

    def submit(self, name: str, call: ControlNetCall) -> PendingResiduals:
        if name not in self._runners:
            raise ControlNetNotFound(name)
        return self._pool.submit(self._runners[name].run, call)

    def close(self) -> None:
        self._pool.shutdown()


class _MeasuredPending:
    def __init__(self, pending: PendingResiduals, name: str, started: float, metrics: Metrics) -> None:
        self._pending, self._name, self._started, self._metrics = pending, name, started, metrics

    def result(self) -> ControlNetResiduals:
        residuals = self._pending.result()
        self._metrics.controlnet_call(self._name, time.perf_counter() - self._started)
        return residuals


class MeasuredControlNets(ControlNetClient):
    """``client`` with each call's latency recorded: from ``submit`` until its residuals are in hand (calls that
    fail are not recorded; they fail their requests, which the request latency records)."""

    def __init__(self, client: ControlNetClient, metrics: Metrics) -> None:
        self._client = client
        self._metrics = metrics

    def names(self) -> list[str]:
        return self._client.names()

    def submit(self, name: str, call: ControlNetCall) -> PendingResiduals:
        started = time.perf_counter()
        return _MeasuredPending(self._client.submit(name, call), name, started, self._metrics)
