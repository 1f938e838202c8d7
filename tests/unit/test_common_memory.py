"""process_memory: which model weights live in this process, each storage counted once."""

import os

import torch

from serving.common.memory import process_memory
from serving.controlnet.models import build_controlnet_preset
from serving.presets import build_preset


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in (*module.parameters(), *module.buffers()))


def test_reports_each_model_class_with_its_weight_bytes() -> None:
    controlnet = build_controlnet_preset("tiny", seed=3)
    holder = {"nets": [controlnet], "other": object()}
    report = process_memory(holder)
    assert report.pid == os.getpid()
    assert report.rss_bytes >= report.uss_bytes > 0
    assert report.model_bytes == {"ControlNetModel": _tensor_bytes(controlnet)}  # its inner models not apart
    assert process_memory().model_bytes == {}  # nothing reachable from no roots


def test_shared_storages_are_counted_once() -> None:
    components = build_preset("tiny")
    alias = components.unet  # a second reference to the same model adds nothing
    counted = process_memory(components, [alias]).model_bytes
    assert counted["UNet2DConditionModel"] == _tensor_bytes(alias)
    assert counted["CLIPTextModel"] == _tensor_bytes(components.text_encoder)
    components.unet.to(torch.float64)  # new storages replace the old ones: the count follows the dtype
    assert process_memory(components).model_bytes["UNet2DConditionModel"] == 2 * counted["UNet2DConditionModel"]
