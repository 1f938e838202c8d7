"""Network helpers shared by tools, benchmarks and tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may still take it later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
