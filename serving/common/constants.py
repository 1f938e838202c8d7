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

#: Name under which responses identify the server (OIP v2 server metadata, OpenAI ``owned_by``).
SERVER_NAME = "swiftserve"
