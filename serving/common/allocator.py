"""The glibc malloc settings every swiftserve replica starts with, and the check that it did.

Under glibc's defaults a freed block above the mmap threshold goes back to the OS, and so does the top of the heap,
so each request's activations fault their pages in again (the page faults that slowed the LoRA rows:
``benchmarks/results/bench_diffusion_more/page-faults/``). ``TUNED_MALLOC_ENV`` keeps freed memory for the next
request instead: one arena (so a block freed by one thread serves the others), no mmap for large blocks, no trimming,
and heap growth padded to whole tensors. A replica's resident memory then stays at its peak rather than rising and
falling with each request. What building the replica freed (a ControlNet copied from a whole seeded pipeline, a
checkpoint's staging copies) would stay too, so once its ``__init__`` returns the replica hands every free page back
to the OS (``malloc_trim``), once.

glibc reads these once, at process start, so they reach a replica through Ray's ``runtime_env.env_vars``: each
deployment's options carry ``REPLICA_RUNTIME_ENV``; a Serve config, whose ``ray_actor_options`` replace the code's,
sets them at the application level. ``checks_allocator`` warns from a replica started without them.
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

from serving.common.logging import get_logger
from serving.common.replica_init import Init, around_init

logger = get_logger("serving.common.allocator")

TUNED_MALLOC_ENV: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30),
    "MALLOC_TOP_PAD_": str(256 * 2**20),
}
#: The ``runtime_env`` of every swiftserve deployment's ``ray_actor_options``.
REPLICA_RUNTIME_ENV: dict[str, dict[str, str]] = {"env_vars": TUNED_MALLOC_ENV}
_START_ENVIRON = Path("/proc/self/environ")


def start_environment(path: Path | None = None) -> dict[str, str] | None:
    """The environment this process was started with (``os.environ`` may have changed since; ``path``: another
    process's ``/proc/<pid>/environ``); None where it cannot be read."""
    path = _START_ENVIRON if path is None else path
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw.split(b"\0") if entry)
    return {name: value for name, _, value in pairs}


def untuned_settings(environment: dict[str, str]) -> dict[str, str]:
    """The settings of ``TUNED_MALLOC_ENV`` that ``environment`` lacks or sets otherwise, with their tuned values."""
    return {name: value for name, value in TUNED_MALLOC_ENV.items() if environment.get(name) != value}


def checks_allocator(init: Init) -> Init:
    """Decorates a replica's ``__init__`` (plain or async) to warn, once it starts, when its process was started
    without ``TUNED_MALLOC_ENV`` (a glibc process whose start environment is readable), and to
    ``release_freed_memory`` once it returns."""
    return around_init(_warn_if_untuned, _release_after_init)(init)


def release_freed_memory(deployment: str | None = None) -> bool:
    """Hands the heap's free pages back to the OS (glibc's ``malloc_trim(0)``, which the tuned settings otherwise
    never do); the blocks stay allocatable, a later request faulting in only the pages it reuses. False where the
    C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    if deployment is not None:
        logger.debug("%s replica: freed memory handed back to the OS after start-up", deployment)
    return True


def _release_after_init(deployment: str) -> None:
    release_freed_memory(deployment)


def _warn_if_untuned(deployment: str) -> str:
    """Warns as ``checks_allocator`` says; ``deployment``, for what runs after ``__init__``."""
    environment = start_environment()
    if environment is None or platform.libc_ver()[0] != "glibc":
        return deployment
    missing = untuned_settings(environment)
    if missing:
        settings = " ".join(f"{name}={value}" for name, value in missing.items())
        logger.warning("%s replica started without swiftserve's malloc settings, so freed memory goes back to the OS "
                       "and each request faults it in again: set runtime_env.env_vars %s (the application's, in a "
                       "Serve config)", deployment, settings)
    return deployment
