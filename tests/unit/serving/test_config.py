"""Diffusion app config: what a device map accepts, and each refusal naming its field; the merged LoRA cache setting."""

import re
from typing import Any

import pytest
from pydantic import ValidationError

from serving.config import DeviceMap, DiffusionAppConfig, ImagesAppConfig, LoRAConfig


def _app(device_map: dict[str, Any], **fields: Any) -> DiffusionAppConfig:
    return DiffusionAppConfig.model_validate(
        {"controlnets": [{"name": "edges"}, {"name": "depth"}], "engine": {"cfg_parallel": True}, **fields,
         "device_map": device_map})


def test_device_map_pins_base_controlnet_and_cfg_worker():
    config = _app({"model": [[0], [2, 3]], "cfg_worker": [[1]], "controlnets": {"edges": [[1]]}})
    assert config.device_map == DeviceMap(model=[[0], [2, 3]], cfg_worker=[[1]], controlnets={"edges": [[1]]})
    assert DiffusionAppConfig().device_map is None


def test_entries_left_out_pin_nothing_and_allow_torch_threads():
    config = _app({"controlnets": {"edges": [[1]]}}, model={"torch_threads": 2})
    assert config.device_map.model == [] and config.device_map.cfg_worker == []
    assert config.model.torch_threads == 2
    config = _app({"model": [[0]]}, controlnets=[{"name": "edges", "torch_threads": 3}])
    assert config.controlnets[0].torch_threads == 3  # `edges` has no entry: not pinned


@pytest.mark.parametrize(("device_map", "fields", "where", "message"), [
    ({"model": [[0, -1]]}, {}, "device_map.model.0.1", "greater than or equal to 0"),
    ({"model": [[0], []]}, {}, "device_map.model", "entry 1 lists no core"),
    ({"cfg_worker": [[1, 2, 1]]}, {}, "device_map.cfg_worker", "entry 0 lists a core twice"),
    ({"controlnets": {"edges": [[]]}}, {}, "device_map.controlnets", "edges: entry 0 lists no core"),
    ({"controlnets": {"canny": [[1]]}}, {}, "", "device_map.controlnets: ['canny'] are not configured"),
    ({"cfg_worker": [[1]]}, {"engine": {"cfg_parallel": False}}, "", "device_map.cfg_worker: there is no CFG"),
    ({"model": [[0]]}, {"model": {"torch_threads": 1}}, "", "model.torch_threads must be null"),
    ({"cfg_worker": [[1]]}, {"model": {"torch_threads": 1}}, "", "model.torch_threads must be null"),
    ({"controlnets": {"depth": [[1]]}}, {"controlnets": [{"name": "edges"}, {"name": "depth", "torch_threads": 1}]},
     "", "controlnets[1].torch_threads must be null"),
], ids=["negative-core", "empty-entry", "duplicate-core", "empty-controlnet-entry", "unknown-controlnet",
        "cfg-worker-without-cfg-parallel", "model-threads", "cfg-worker-threads", "controlnet-threads"])
def test_bad_device_map_is_refused_naming_the_field(device_map, fields, where, message):
    with pytest.raises(ValidationError) as caught:
        _app(device_map, **fields)
    (error,) = caught.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == where
    assert message in error["msg"]


def test_a_controlnet_preset_must_be_the_model_presets_own():
    config = DiffusionAppConfig.model_validate({"model": {"preset": "sdxl-tiny"},
                                                "controlnets": [{"name": "edges", "preset": "sdxl-tiny"}]})
    assert config.controlnets[0].preset == "sdxl-tiny"
    with pytest.raises(ValidationError, match=r"controlnets\[1\]\.preset 'tiny' is built for the 'tiny' model, not "
                                              r"model\.preset 'sdxl-tiny'"):
        DiffusionAppConfig.model_validate({"model": {"preset": "sdxl-tiny"}, "controlnets": [
            {"name": "a", "preset": "sdxl-tiny"}, {"name": "b"}]})  # a ControlNet's preset defaults to `tiny`
    local = DiffusionAppConfig.model_validate({"model": {"preset": None, "path": "/models/sdxl"},
                                               "controlnets": [{"name": "edges"}]})
    assert local.controlnets[0].preset == "tiny"  # a local model's architecture is known once loaded, not here


def test_merged_lora_cache_is_auto_by_default_and_takes_bytes_or_auto_only():
    assert LoRAConfig().merged_cache_bytes == "auto"
    assert LoRAConfig(merged_cache_bytes=0).merged_cache_bytes == 0
    for bad in (-1, "all", 1.5):
        with pytest.raises(ValidationError, match="merged_cache_bytes"):
            LoRAConfig(merged_cache_bytes=bad)


@pytest.mark.parametrize(("engine", "device_map", "parallel", "why"), [
    ({}, None, False, "auto: off, no device of its own"),
    ({}, {"model": [[0]], "cfg_worker": [[1]]}, True, r"auto: on, the CFG worker has cores \[1\] of its own"),
    ({}, {"model": [[0], [1]], "cfg_worker": [[1]]}, False, r"shares cores \[1\] with device_map.model"),
    ({"cfg_parallel": True}, {"model": [[0]], "cfg_worker": [[0]]}, True, "engine.cfg_parallel: true"),
    ({"cfg_parallel": False}, None, False, "engine.cfg_parallel: false"),
])
def test_cfg_worker_runs_by_default_only_on_a_device_of_its_own(engine, device_map, parallel, why):
    config = DiffusionAppConfig.model_validate({"engine": engine, "device_map": device_map})
    assert config.engine.cfg_parallel == engine.get("cfg_parallel", "auto")
    chosen, reason = config.cfg_worker_choice()
    assert chosen is parallel
    assert re.search(why, reason), reason


def _models(*device_maps: dict[str, Any] | None, shared: bool = True) -> ImagesAppConfig:
    return ImagesAppConfig.model_validate({"shared_replicas": shared, "models": [
        {"model": {"name": f"m{k}", "preset": "tiny"}, "device_map": device_map}
        for k, device_map in enumerate(device_maps)]})


def test_shared_replicas_take_the_models_common_cores():
    assert _models({"model": [[0], [1]]}, {"model": [[0], [1]]}).group_cores() == [[0], [1]]
    assert _models(None, {"model": []}).group_cores() == []  # none pinned: equal
    assert _models({"model": [[0]]}, {"model": [[1]]}, shared=False).models[1].device_map.model == [[1]]


def test_shared_replicas_refuse_models_pinned_apart_naming_the_field_and_the_model():
    with pytest.raises(ValidationError, match=re.escape(
            "shared_replicas: every model's device_map.model must be equal; 'm1' has [[1]], 'm0' [[0]]")):
        _models({"model": [[0]]}, {"model": [[1]]})
