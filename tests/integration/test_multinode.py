"""A node joined as docs/DEPLOYMENT.md says, on this machine: the session cluster authenticates with a token (as a
`ray start --head` cluster does); `ray start --address` without it is refused, with `RAY_AUTH_MODE=token` and
`RAY_AUTH_TOKEN` the node joins with its custom resource, and the DLRM pool that asks for it runs there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from autoconfig.serve_config import load_serve_config
from tests.helpers import REPO
from tests.helpers.replicas import answers_from_replicas
from tests.helpers.serve_apps import deployed_beside
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.integration

RAY = str(Path(sys.executable).with_name("ray"))
POOL = "joined_pool"


def _start_node(address: str, env: dict[str, str]) -> subprocess.Popen:
    """`ray start --address` as the docs write it, blocking so that ending the process stops the node."""
    return subprocess.Popen([RAY, "start", "--address", address, "--num-cpus=0", "--object-store-memory=80000000",
                             f"--resources={json.dumps({POOL: 1})}", "--block"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _joined_node_id(node: subprocess.Popen) -> str:
    def joined() -> str | None:
        ids = [n["NodeID"] for n in ray.nodes() if n["Alive"] and POOL in n["Resources"]]
        assert ids or node.poll() is None, f"the node exited: {node.stdout.read()}"
        return ids[0] if ids else None

    return wait_for(joined, "the node did not join", timeout_s=120, period_s=0.5)


def _app() -> dict:
    """deploy/serve_config.yaml's DLRM app with its dense replica on the joined node's resource, shards on the head."""
    config = load_serve_config(REPO / "deploy" / "serve_config.yaml")
    dlrm = next(app for app in config.model_dump(exclude_unset=True)["applications"] if app["name"] == "dlrm")
    dlrm.update(name="dlrm-joined", route_prefix="/joined/v2")
    dlrm["deployments"] = [
        {"name": "DisaggregatedDLRM", "ray_actor_options": {"num_cpus": 0, "resources": {POOL: 1}}},
        *({"name": f"EmbeddingShard_{shard}", "ray_actor_options": {"num_cpus": 0.01}} for shard in range(2)),
        {"name": "ShardDirectory", "ray_actor_options": {"num_cpus": 0}},
    ]
    return dlrm


def test_a_node_started_as_documented_joins_and_takes_the_pool_asking_for_its_resource(base_url, cluster, tmp_path):
    bare = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    bare["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either: a fresh machine
    refused = _start_node(cluster.address, bare)
    output, _ = refused.communicate(timeout=120)
    assert refused.returncode != 0 and "Authentication token is missing or incorrect" in output, output
    assert not [n for n in ray.nodes() if n["Alive"] and POOL in n["Resources"]]

    documented = bare | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]}
    node = _start_node(cluster.address, documented)
    try:
        joined = _joined_node_id(node)
        with deployed_beside([_app()]):
            assert set(answers_from_replicas("dlrm-joined", "DisaggregatedDLRM", "node_id", 1)) == {joined}
            assert set(answers_from_replicas("dlrm-joined", "EmbeddingShard_0", "node_id", 1)) != {joined}
    finally:
        node.terminate()
        node.communicate(timeout=120)
