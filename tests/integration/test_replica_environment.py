"""The session cluster's replicas, deployed from deploy/serve_config.yaml (whose deployments' ``ray_actor_options``
replace the code's), each started with the tuned malloc settings."""

from __future__ import annotations

from pathlib import Path

from serving.common.allocator import start_environment, untuned_settings
from serving.common.memory import serve_processes

_REPLICAS = ("DiffusionModel", "CFGWorker", "ControlNet", "MonolithicDLRM", "DisaggregatedDLRM", "EmbeddingShard")


def test_every_model_replica_process_started_with_the_tuned_malloc_settings(base_url):
    processes = serve_processes()
    deployments = {name: name.split("#")[0].split(":")[-1] for name in processes if name.startswith("ServeReplica:")}
    replicas = {name: processes[name] for name, deployment in deployments.items() if deployment.startswith(_REPLICAS)}
    kinds = {deployments[name].split("_")[0] for name in replicas}
    assert kinds >= {"DiffusionModel", "CFGWorker", "ControlNet", "DisaggregatedDLRM", "EmbeddingShard"}, kinds
    untuned = {name: untuned_settings(start_environment(Path(f"/proc/{process.pid}/environ")) or {})
               for name, process in replicas.items()}
    assert {name: missing for name, missing in untuned.items() if missing} == {}
