"""Remote LoRA storage, emulated: every read of a LoRA file first waits a fetch time drawn from measured ones.

A production service fetches LoRA files from remote storage; here they sit in a local directory, so the benchmark
adds the fetch. ``install`` is a Ray ``worker_process_setup_hook`` (``EmulatedStorage.runtime_env``): in every
worker it reads the storage's description from the file ``ENV`` names and, once swiftserve's LoRA cache module is
imported (not before: a worker imports nothing heavy while it starts), wraps its file read
(``serving.lora.cache.load_lora_file``); a baseline that reads LoRA files itself calls ``fetch(name)`` first. The
``k``-th fetch of a LoRA in a process waits ``samples_ms[j] / compression`` milliseconds, ``j`` drawn from
``(seed, name, k)``: every system pays the same draws for the same fetches, however their loads interleave.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import sleep

import numpy as np

REPO = Path(__file__).resolve().parent.parent
#: The environment variable carrying the storage's description to every worker.
ENV = "SWIFTSERVE_BENCH_LORA_STORAGE"


@dataclass
class EmulatedStorage:
    """Fetch times of LoRA files: ``samples_ms`` (measured load latencies) divided by ``compression``."""

    samples_ms: Sequence[float]
    compression: float
    seed: int = 0
    _fetches: Counter[str] = field(default_factory=Counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def delay_s(self, name: str) -> float:
        """Seconds the next fetch of ``name`` in this process takes (each call is one more fetch)."""
        with self._lock:
            count = self._fetches[name]
            self._fetches[name] += 1
        draw = np.random.default_rng([self.seed, zlib.crc32(name.encode()), count]).integers(len(self.samples_ms))
        return float(self.samples_ms[draw]) / 1e3 / self.compression

    def fetch(self, name: str) -> None:
        sleep(self.delay_s(name))

    def runtime_env(self, directory: Path) -> dict:
        """The Ray ``runtime_env`` that installs this storage in every worker of a job: its description goes to a
        file in ``directory`` (too large for an environment variable), named by ``ENV``; the hook runs before Ray
        puts the driver's directory on a worker's path, so ``PYTHONPATH`` names this repository."""
        description = Path(directory) / "lora_storage.json"
        description.write_text(json.dumps({"samples_ms": [float(s) for s in self.samples_ms],
                                           "compression": self.compression, "seed": self.seed}))
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        return {"worker_process_setup_hook": f"{__name__}.install",
                "env_vars": {ENV: str(description), "PYTHONPATH": path}}


#: The module whose LoRA file read gets the fetch.
CACHE_MODULE = "serving.lora.cache"
_storage: EmulatedStorage | None = None


def install() -> None:
    """Ray worker setup hook: builds this process's storage from the file ``ENV`` names and puts the fetch before
    every LoRA file read of swiftserve's LoRA cache. Nothing without ``ENV``."""
    global _storage
    description = os.environ.get(ENV)
    if not description:
        return
    _storage = EmulatedStorage(**json.loads(Path(description).read_text()))
    if CACHE_MODULE in sys.modules:
        _wrap_read(sys.modules[CACHE_MODULE])
    else:
        sys.meta_path.insert(0, _WrapOnImport())


def _wrap_read(cache) -> None:
    read = cache.load_lora_file

    @functools.wraps(read)
    def fetched_then_read(path: Path, **kwargs):
        fetch(Path(path).stem)
        return read(path, **kwargs)

    cache.load_lora_file = fetched_then_read


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds ``CACHE_MODULE`` as the other finders do, and wraps its read once it has run."""

    def find_spec(self, name, path, target=None):
        if name != CACHE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_wrap(module) -> None:
            exec_module(module)
            _wrap_read(module)

        spec.loader.exec_module = exec_then_wrap
        return spec


def fetch(name: str) -> None:
    """The fetch of LoRA ``name`` from the installed storage; nothing when none is installed."""
    if _storage is not None:
        _storage.fetch(name)
