"""LoRA loads a test holds back, to put a request at a chosen point of its denoising before its LoRA arrives."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from serving.engine import DiffusionEngine
from serving.engine.request import RequestState
from serving.lora.format import load_lora_file
from serving.lora.weights import LoRAWeights
from tests.helpers.waiting import wait_for

TIMEOUT_S = 60  # every wait is bounded, so a bug fails instead of hanging


def held_loader(engine: DiffusionEngine, release: threading.Event) -> Callable[[Path], LoRAWeights]:
    """A ``LoRACache`` loader whose loads finish only once ``release`` is set."""

    def load(path: Path) -> LoRAWeights:
        assert release.wait(TIMEOUT_S), "the held LoRA load was never released"
        return load_lora_file(path, engine.lora_targets, max_file_bytes=2**30)

    return load


def release_once_blocked(state: RequestState, release: threading.Event) -> None:
    """Sets ``release`` once the engine loop marked ``state`` as standing still for its LoRAs (or, failing, after
    ``TIMEOUT_S``: the test then fails on what it checks)."""
    try:
        wait_for(lambda: state.blocked_since is not None, "the request never stood still for its LoRAs",
                 timeout_s=TIMEOUT_S, period_s=0.002)
    finally:
        release.set()


def prepared(state: RequestState) -> None:
    """Waits (called from a step hook, after the release) until the request's LoRAs are loaded and prepared on the
    stage thread, so the engine loop applies them before the request's next step."""
    activation = wait_for(lambda: state.lora_activation, "the LoRAs were never handed to the stage thread",
                          timeout_s=TIMEOUT_S, period_s=0.002)
    activation.result(timeout=TIMEOUT_S)
