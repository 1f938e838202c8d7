"""process_memory: which model weights live in this process, each storage counted once; serve_processes."""

import os
import subprocess
import time

import torch

from serving.common.memory import process_memory, serve_processes
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
    alias = components.denoiser  # a second reference to the same model adds nothing
    counted = process_memory(components, [alias]).model_bytes
    assert counted["UNet2DConditionModel"] == _tensor_bytes(alias)
    assert counted["CLIPTextModel"] == _tensor_bytes(components.text_encoder)
    components.denoiser.to(torch.float64)  # new storages replace the old ones: the count follows the dtype
    assert process_memory(components).model_bytes["UNet2DConditionModel"] == 2 * counted["UNet2DConditionModel"]


def test_serve_processes_are_found_by_their_ray_title_and_nothing_else():
    titles = ["ray::ServeReplica:dlrm-mono:EmbeddingShard_0.check_health", "ray::ProxyActor", "ray::IDLE",
              "python ray::ServeReplica:x:y"]
    children = [subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep 30']) for title in titles]
    try:
        deadline = time.monotonic() + 10
        while (found := {name for name in serve_processes() if int(name.split("#")[1]) in
                         {child.pid for child in children}}) != {
                f"ServeReplica:dlrm-mono:EmbeddingShard_0#{children[0].pid}", f"ProxyActor#{children[1].pid}"}:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
    finally:
        for child in children:
            child.kill()
            child.wait()
