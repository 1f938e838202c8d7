"""bench_diffusion_throughput's contenders: the Serve config applications it deploys, without Ray."""

import argparse

from ray.serve.schema import ServeApplicationSchema

from benchmarks import bench_diffusion_throughput as bench
from serving.common.allocator import REPLICA_RUNTIME_ENV
from serving.config import DiffusionAppConfig


def _args(controlnets: int) -> argparse.Namespace:
    return argparse.Namespace(preset="tiny", steps=2, device="cpu", dtype="float32", controlnets=controlnets,
                              admission_wait_fraction=0.25)


def test_ours_runs_a_model_replica_on_each_core_and_deals_the_controlnets_over_them(tmp_path):
    contenders = {system.name: system for system in bench.systems(_args(3), tmp_path)}
    assert list(contenders) == list(bench.SYSTEMS)
    ours = contenders["ours"]
    assert ours.device_map == {"DiffusionModel": [[0], [1]], "ControlNet_cn0": [[0]], "ControlNet_cn1": [[1]],
                               "ControlNet_cn2": [[0]]}
    app = ServeApplicationSchema.model_validate(ours.app)
    assert app.import_path == "serving.app:build_app" and app.runtime_env == REPLICA_RUNTIME_ENV
    assert {deployment.name: deployment.num_replicas for deployment in app.deployments} == {
        "DiffusionModel": 2, "ControlNet_cn0": 1, "ControlNet_cn1": 1, "ControlNet_cn2": 1}
    config = DiffusionAppConfig.model_validate(app.args)
    assert config.device_map.model == [[0], [1]] and config.engine.continuous_batching
    assert config.lora.directory == tmp_path
    off = DiffusionAppConfig.model_validate(contenders["ours_cb_off"].app["args"])
    assert not off.engine.continuous_batching and off.device_map == config.device_map


def test_the_baselines_are_diffusers_apps_one_on_both_cores_and_one_replica_per_core(tmp_path):
    contenders = {system.name: system for system in bench.systems(_args(1), tmp_path)}
    vanilla, strongest = (ServeApplicationSchema.model_validate(contenders[name].app)
                          for name in ("vanilla", "strongest_vanilla"))
    assert vanilla.import_path == strongest.import_path == "benchmarks.vanilla:build_vanilla_app"
    assert (vanilla.args["cores"], vanilla.args["adapters"]) == ([[0, 1]], False)
    assert (strongest.args["cores"], strongest.args["adapters"]) == ([[0], [1]], True)
    assert vanilla.runtime_env == strongest.runtime_env == REPLICA_RUNTIME_ENV
