"""Logging setup: one format for every replica, level from ``SWIFTSERVE_LOG_LEVEL``."""

from __future__ import annotations

import logging

from serving.common import constants

_ROOT = "swiftserve"


def get_logger(name: str) -> logging.Logger:
    """A child of the ``swiftserve`` logger, configured on first use."""
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(constants.LOG_LEVEL)
        root.propagate = False
    return root.getChild(name)
