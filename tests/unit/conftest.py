"""Unit tests never start Ray and never leave the machine: outbound connections are refused."""

import ipaddress
import logging
import socket

import pytest
import torch

from serving.config import DiffusionAppConfig, DiffusionModelConfig, GenerationDefaults
from serving.controlnet.client import LocalControlNets
from serving.controlnet.models import build_controlnet_preset
from serving.controlnet.runner import ControlNetRunner
from serving.engine import DiffusionEngine

_real_connect = socket.socket.connect


def _loopback_only(sock: socket.socket, address) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        host = address[0]
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise ConnectionRefusedError(f"unit tests may not connect to {host}")
    return _real_connect(sock, address)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _loopback_only)


@pytest.fixture(scope="session")
def tiny_engine() -> DiffusionEngine:
    """The tiny preset (seeded weights, as `build_preset("tiny")` gives) on CPU with an in-process ControlNet
    ``edges``; modules are frozen, so sharing is safe."""
    controlnets = LocalControlNets({"edges": ControlNetRunner(build_controlnet_preset("tiny"), torch.device("cpu"))})
    return DiffusionEngine.from_config(DiffusionModelConfig(preset="tiny", weights="seeded", device="cpu"),
                                       controlnets=controlnets)


@pytest.fixture(scope="session")
def fast_config() -> DiffusionAppConfig:
    """Two denoising steps by default, so HTTP round trips stay fast."""
    return DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=2))


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture):
    """Every record at DEBUG, including swiftserve's own loggers (which do not propagate to the root)."""
    ours = logging.getLogger("swiftserve")
    level = ours.level
    ours.addHandler(caplog.handler)
    ours.setLevel(logging.DEBUG)
    caplog.set_level(logging.DEBUG)
    try:
        yield caplog
    finally:
        ours.removeHandler(caplog.handler)
        ours.setLevel(level)
