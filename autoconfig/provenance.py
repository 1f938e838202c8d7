"""What measured a trial: the swiftserve commit and the machine, so that profiles taken at different versions or on
different hardware can be told apart (a bank entry profiled before a change to the serving path, or on another
CPU, measures another system)."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
_CPUINFO = Path("/proc/cpuinfo")


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


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (e.g. ``AMD EPYC 7B13``); the architecture where it has none."""
    try:
        lines = _CPUINFO.read_text().splitlines()
    except OSError:
        lines = []
    models = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return next((model for model in models if model), None) or platform.processor() or platform.machine()


@cache
def machine_id() -> str:
    """The hardware of the node this process runs on (a one-node cluster's), in one line: the CPU model and count,
    and the first GPU torch sees, e.g. ``Intel(R) Xeon(R) Processor x2`` or ``AMD EPYC 9654 x16, NVIDIA H200``."""
    described = f"{cpu_model()} x{os.cpu_count()}"
    try:
        import torch
    except ImportError:
        return described
    return described + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "")
