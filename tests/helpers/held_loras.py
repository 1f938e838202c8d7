"""LoRA loads a test holds back, to put a request at a chosen point of its denoising before its LoRA arrives."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from serving.engine import DiffusionEngine
from serving.engine.request import RequestState
from serving.lora.format import load_lora_file
from serving.lora.weights import LoRAWeights

TIMEOUT_S = 60  # every wait is bounded, so a bug fails instead of hanging


def held_loader(engine: DiffusionEngine, release: threading.Event) -> Callable[[Path], LoRAWeights]:
    """A ``LoRACache`` loader whose loads finish only once ``release`` is set."""

    def load(path: Path) -> LoRAWeights:
        assert release.wait(TIMEOUT_S), "the held LoRA load was never released"
        return load_lora_file(path, engine.lora_targets, max_file_bytes=2**30)

    return load


def release_once_blocked(state: RequestState, release: threading.Event) -> None:
    """Sets ``release`` only after the engine loop marked ``state`` as standing still for its LoRAs."""
    deadline = time.monotonic() + TIMEOUT_S
    while state.blocked_since is None and time.monotonic() < deadline:
        time.sleep(0.002)
    release.set()


def prepared(state: RequestState) -> None:
    """Waits (called from a step hook, after the release) until the request's LoRAs are loaded and prepared on the
    stage thread, so the engine loop applies them before the request's next step."""
    deadline = time.monotonic() + TIMEOUT_S
    while state.lora_activation is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert state.lora_activation is not None, "the LoRAs were never handed to the stage thread"
    state.lora_activation.result(timeout=TIMEOUT_S)
