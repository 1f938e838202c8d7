"""Host-memory LRU of loaded LoRAs, with background loading and one shared load per file.

``get`` never blocks on I/O: it answers a future that is already done (a hit), the future of a load in
flight (requests for the same LoRA share one read), or the future of a new load on the worker pool. An
entry is keyed by name and by the file's identity (real path, size, mtime), so a replaced file is reloaded.
A caller that no longer needs a load says so (``release``): a load nobody waits for any more is dropped while it is
still queued for a worker; one already reading finishes and is cached.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from serving.common.logging import get_logger
from serving.common.metrics import NO_METRICS, LoRALookup, Metrics
from serving.config import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_TENSORS
from serving.lora.format import LoRAFormatError, LoRATargets, check_lora_family, load_lora_file
from serving.lora.registry import InvalidLoRAName, LoRANotFound, LoRARegistry
from serving.lora.weights import LoRAWeights

logger = get_logger("lora.cache")

_FileKey = tuple[Path, int, int]  # real path, size, mtime_ns


@dataclass(frozen=True)
class _Entry:
    key: _FileKey
    weights: LoRAWeights


@dataclass(eq=False)
class _Load:
    """A load in flight: the future its callers share, the worker pool's task, how many callers still wait."""

    key: _FileKey
    future: Future[LoRAWeights]
    task: Future[None] | None = None
    waiters: int = 1


class LoRACache:
    """LRU by bytes over ``registry``'s LoRAs, loaded on ``max_workers`` background threads."""

    def __init__(
        self,
        registry: LoRARegistry,
        targets: LoRATargets,
        *,
        budget_bytes: int,
        max_file_bytes: int,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_tensors: int = DEFAULT_MAX_TENSORS,
        max_workers: int = 2,
        dtype: torch.dtype = torch.float32,
        loader: Callable[[Path], LoRAWeights] | None = None,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.registry = registry
        self._metrics = metrics
        self.budget_bytes = budget_bytes
        self._loader = loader or functools.partial(
            load_lora_file, targets=targets, max_file_bytes=max_file_bytes, max_header_bytes=max_header_bytes,
            max_tensors=max_tensors, dtype=dtype,
        )
        self._family_check = functools.partial(check_lora_family, targets=targets, max_file_bytes=max_file_bytes,
                                               max_header_bytes=max_header_bytes, max_tensors=max_tensors)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="lora-load")
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._loads: dict[str, _Load] = {}
        self._bytes = 0
        self._hits = self._misses = self._shared = self._loads_failed = self._loads_cancelled = self._evictions = 0

    def get(self, name: str) -> Future[LoRAWeights]:
        """The LoRA's weights, now or later. ``InvalidLoRAName`` / ``LoRANotFound`` raise here, synchronously."""
        key = self._file_key(name)
        with self._lock:
            future, outcome = self._lookup(name, key)
            self._metrics.lora_cache_bytes(self._bytes)  # under the lock: gauge updates keep their order
        self._metrics.lora_lookup(outcome)
        return future

    def _lookup(self, name: str, key: _FileKey) -> tuple[Future[LoRAWeights], LoRALookup]:
        """``get`` under the lock: the future and whether it was a hit, a new load or a load in flight."""
        entry = self._entries.get(name)
        if entry is not None and entry.key == key:
            self._entries.move_to_end(name)
            self._hits += 1
            done: Future[LoRAWeights] = Future()
            done.set_result(entry.weights)
            return done, "hit"
        if entry is not None:  # the file was replaced
            self._drop(name)
        load = self._loads.get(name)
        if load is not None and load.key == key:
            self._shared += 1
            load.waiters += 1
            return load.future, "shared"
        future: Future[LoRAWeights] = Future()
        future.set_running_or_notify_cancel()  # shared by many callers: none of them may cancel it (``release``)
        load = _Load(key, future)
        load.task = self._pool.submit(self._run, name, load)
        self._loads[name] = load
        self._misses += 1
        return future, "new"

    def release(self, name: str, future: Future[LoRAWeights]) -> None:
        """A caller of ``get`` no longer needs ``future``. Once no caller waits for that load and no worker has
        begun it, it is dropped (its future fails with ``CancelledError``); a load a worker has begun is kept."""
        with self._lock:
            load = self._loads.get(name)
            if load is None or load.future is not future:  # a hit, or finished
                return
            load.waiters -= 1
            if load.waiters > 0 or load.task is None or not load.task.cancel():
                return
            del self._loads[name]
            self._loads_cancelled += 1
        load.future.set_exception(CancelledError(f"the load of LoRA {name!r} was dropped: no request waits for it"))

    def names(self) -> list[str]:
        """The registry's LoRAs this model may take: those whose file header shows no other family's LoRA (a
        directory shared by models of several families lists each LoRA with the models it is for)."""
        fitting = []
        for name, path in self.registry.paths().items():
            try:
                self._family_check(path)
            except LoRAFormatError:
                continue
            fitting.append(name)
        return fitting

    def contains(self, name: str) -> bool:
        """Whether ``name`` is cached and its file unchanged (no counters move)."""
        try:
            key = self._file_key(name)
        except (InvalidLoRAName, LoRANotFound):
            return False
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and entry.key == key

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "shared_loads": self._shared,
                "loads_failed": self._loads_failed,
                "loads_cancelled": self._loads_cancelled,
                "loading": len(self._loads),
                "entries": len(self._entries),
                "bytes": self._bytes,
                "budget_bytes": self.budget_bytes,
                "evictions": self._evictions,
            }

    def close(self, wait: bool = True) -> None:
        """Stop the loader threads. Loads already queued still finish, so no caller waits forever."""
        self._pool.shutdown(wait=wait)

    def _file_key(self, name: str) -> _FileKey:
        path = self.registry.resolve(name)
        try:
            return (path, *self.registry.fingerprint(path))
        except OSError:  # removed since resolve
            raise LoRANotFound(name) from None

    def _run(self, name: str, load: _Load) -> None:
        """Worker: load, update the cache under the lock, then complete the future (so waiters see the entry)."""
        started = time.perf_counter()
        try:
            weights = self._loader(load.key[0])
        except BaseException as exc:  # any failure belongs to the callers, and leaves nothing behind
            with self._lock:
                self._loads_failed += 1
                if self._loads.get(name) is load:
                    del self._loads[name]
            logger.warning("LoRA %r failed to load: %s", name, exc)
            load.future.set_exception(exc)
            return
        if weights.name != name:  # loaded through a symlink alias
            weights = replace(weights, name=name)
        with self._lock:
            if self._loads.get(name) is load:  # not superseded by a load of a newer file
                del self._loads[name]
                self._insert(name, _Entry(load.key, weights))
            self._metrics.lora_cache_bytes(self._bytes)
        modules = weights.modules
        logger.info("LoRA %r loaded: %d modules, %.1f MiB in %.2fs", name, modules, weights.nbytes / 2**20,
                    time.perf_counter() - started)
        load.future.set_result(weights)

    def _insert(self, name: str, entry: _Entry) -> None:
        if name in self._entries:
            self._drop(name)
        size = entry.weights.nbytes
        if size > self.budget_bytes:
            logger.warning("LoRA %r (%d bytes) exceeds the cache budget (%d bytes); not cached", name, size,
                           self.budget_bytes)
            return
        self._entries[name] = entry
        self._bytes += size
        while self._bytes > self.budget_bytes:
            evicted, old = self._entries.popitem(last=False)
            self._bytes -= old.weights.nbytes
            self._evictions += 1
            logger.info("LoRA %r evicted from the cache", evicted)

    def _drop(self, name: str) -> None:
        self._bytes -= self._entries.pop(name).weights.nbytes
