"""How the engine reaches ControlNets: ``submit`` one call, get something with ``.result()`` back.

``LocalControlNets`` runs them in this process on worker threads (tests, a single-process server); the
Serve deployment's client (``serving.deployments``) sends calls to shared ControlNet deployments.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from serving.controlnet.runner import ControlNetCall, ControlNetResiduals, ControlNetRunner


class PendingResiduals(Protocol):
    def result(self) -> ControlNetResiduals: ...


class ControlNetNotFound(LookupError):
    """No ControlNet of that name is served."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class ControlNetUnavailable(RuntimeError):
    """A ControlNet call failed (its replica died, timed out, or raised); ``name`` says which ControlNet."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"ControlNet {name!r} is unavailable: {type(cause).__name__}: {cause}")
        self.name = name


class ControlNetClient(Protocol):
    def names(self) -> list[str]: ...

    def submit(self, name: str, call: ControlNetCall) -> PendingResiduals: ...


class LocalControlNets:
    """In-process ControlNets, each call on a worker thread so they overlap the UNet's down blocks."""

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
