"""Every environment variable swiftserve reads, read once, here.

Nothing else in the code base calls ``os.environ`` for configuration: config models take their
defaults from the names below, so a value can be traced to one place.
"""

from __future__ import annotations

import os

#: Python logging level for swiftserve's own loggers (``DEBUG``, ``INFO``, ...).
LOG_LEVEL: str = os.environ.get("SWIFTSERVE_LOG_LEVEL", "INFO").upper()

#: Force a torch device for every model replica (``cpu``, ``cuda``, ``cuda:1``); empty means
#: CUDA when available, else CPU.
DEVICE_OVERRIDE: str = os.environ.get("SWIFTSERVE_DEVICE", "")

#: Cap on the CUDA caching allocator of every model replica, as a fraction of the device's memory
#: (``torch.cuda.set_per_process_memory_fraction``); set per deployment by ``autoconfig`` device shares.
CUDA_MEMORY_FRACTION: float | None = (
    float(os.environ["SWIFTSERVE_CUDA_MEMORY_FRACTION"]) if os.environ.get("SWIFTSERVE_CUDA_MEMORY_FRACTION") else None
)

#: CPUs a replica may use, enforced at its start (``serving.common.cpu_share``: a CFS quota, whole cores pinned);
#: set per deployment by ``autoconfig`` device shares on CPU. Unset: no limit beyond Ray's reservation.
CPU_SHARE: float | None = float(os.environ["SWIFTSERVE_CPU_SHARE"]) if os.environ.get("SWIFTSERVE_CPU_SHARE") else None

#: API key of both HTTP apps, enforced by ``serving.common.auth``; empty or unset means auth is off.
#: Surrounding whitespace (a trailing newline from a secret file) is dropped: HTTP cannot carry it.
API_KEY: str = os.environ.get("SWIFTSERVE_API_KEY", "").strip()

#: Token dense replicas send and embedding shards demand (``disagg.rpc``); empty or unset means no token.
#: Surrounding whitespace is dropped; use printable ASCII (``openssl rand -hex 32``).
EMBEDDING_TOKEN: str = os.environ.get("SWIFTSERVE_EMBEDDING_TOKEN", "").strip()

#: Name under which responses identify the server (OIP v2 server metadata, OpenAI ``owned_by``).
SERVER_NAME = "swiftserve"
