"""Which code measured a trial: the swiftserve commit, so that profiles taken at different versions can be told
apart (a bank entry profiled before a change to the serving path measures another system)."""

from __future__ import annotations

import subprocess
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


@cache
def code_version() -> str:
    """The commit of the swiftserve checkout this package runs from, ``-dirty`` when tracked files differ from it;
    without a git checkout, ``swiftserve <version>`` of the installed package (``unknown`` if not installed)."""
    try:
        commit = _git("rev-parse", "HEAD")
        return commit + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or git hung
        try:
            return f"swiftserve {version('swiftserve')}"
        except PackageNotFoundError:
            return "unknown"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=_CHECKOUT, capture_output=True, text=True, check=True,
                          timeout=10).stdout.strip()
