"""Each pool of the disaggregated DLRM autoscales on its own bottleneck (``disagg.deployments.autoscaling``): a
lookup-heavy load grows the embedding shards and not the dense replicas, a dense-heavy load the reverse.

The app (``dlrm-autoscaling`` at /autoscaling/v2) is deployed beside the session's applications on the session cluster
(started here, and stopped again, when no other test started Serve) and deleted at the end. Both pools run
``BusyTimePolicy`` with short delays and look-back periods, between one and two replicas, on the simulated pool nodes.
Every process shares the machine's cores, so a pool's busy fraction stays well below 1 even when it is the
bottleneck. Under the lookup-heavy load the dense replica reports about as much busy time as the shard (it
deduplicates and pools every id the shard gathers); under the dense-heavy load it is busy nearly all the time and the
shard nearly never. So no one target sits between both pools' figures: each pool's ``TARGET_UTILIZATION`` sits between
what it reports under its own load and under the other one, a factor of about two from each on a 2-core machine.

Lookup-heavy: one row per request with 1024 uniformly drawn ids per bag, so each request makes the shard gather
thousands of distinct int8 rows (several chunks under a 1 MiB message limit) while the dense stages compute one row.
Dense-heavy: 4096 one-hot rows per request over four ids per table, so few, small lookups feed large MLP batches.
"""

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from ray.serve.context import _get_global_client

from disagg.deployments.autoscaling import BusyTimePolicy
from disagg.spec import preset_spec
from tests.helpers.serve_apps import deployed_beside
from tests.integration.conftest import POOLS

pytestmark = pytest.mark.integration

APP, ROUTE = "dlrm-autoscaling", "/autoscaling/v2"
PRESET = "small"
DENSE, SHARD = "DisaggregatedDLRM", "EmbeddingShard_0"
#: Per pool: between its busy fraction under its own load and under the other pool's (see the module docstring)
TARGET_UTILIZATION = {DENSE: 0.5, SHARD: 0.1}
GROWTH_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 120.0


def _autoscaling(deployment: str) -> dict[str, Any]:
    """Short delays and look-back periods, one or two replicas, ``BusyTimePolicy`` at the pool's own target."""
    return {
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 2.0,
        "look_back_period_s": 2.0,
        "metrics_interval_s": 0.5,  # replicas push their metrics this often (Serve's default: every 10 s)
        "policy": {
            "policy_function": f"{BusyTimePolicy.__module__}:{BusyTimePolicy.__name__}",
            "policy_kwargs": {"target_utilization": TARGET_UTILIZATION[deployment]},
        },
    }


@dataclass(frozen=True)
class Load:
    """Closed-loop ``users``, each posting requests of ``rows`` rows with ``hotness`` ids per bag drawn uniformly
    below ``min(table rows, id_range)`` (the whole table when None)."""

    rows: int
    hotness: int
    id_range: int | None
    users: int


LOOKUP_HEAVY = Load(rows=1, hotness=1024, id_range=None, users=3)
DENSE_HEAVY = Load(rows=4096, hotness=1, id_range=4, users=2)


def _app_config() -> dict[str, Any]:
    pools = {DENSE: POOLS["dense"], SHARD: POOLS["embedding"]}
    return {
        "name": APP,
        "route_prefix": ROUTE,
        "import_path": "disagg.app:build_app",
        "args": {
            "model_name": "dlrm",
            "model": {"preset": PRESET, "torch_threads": 1},
            "serving": "disaggregated",
            "embedding": {"num_shards": 1, "bind_host": "node", "torch_threads": 1, "storage_dtype": "int8",
                          "max_message_bytes": 1 << 20},
            "limits": {"max_ids_per_feature": LOOKUP_HEAVY.hotness},
        },
        "deployments": [
            *({"name": name, "ray_actor_options": {"num_cpus": 0, "resources": {pool: 1}},
               "autoscaling_config": _autoscaling(name)} for name, pool in pools.items()),
            {"name": "ShardDirectory", "ray_actor_options": {"num_cpus": 0}},
        ],
    }


@pytest.fixture(scope="module")
def infer_url(cluster) -> Iterator[str]:
    """The app's infer URL, deployed beside whatever the session deployed; Serve is left as it was found."""
    with deployed_beside([_app_config()]) as port:
        yield f"http://127.0.0.1:{port}{ROUTE}/models/dlrm/infer"


def _bodies(load: Load, seed: int, count: int = 4) -> list[tuple[bytes, dict[str, str]]]:
    """``count`` infer bodies of ``load``'s shape, with binary tensors (the JSON codec would dominate the cost)."""
    spec = preset_spec(PRESET)
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        dense = rng.random((load.rows, spec.num_dense), dtype=np.float32)
        sparse = np.stack([rng.integers(0, min(rows, load.id_range or rows), (load.rows, load.hotness))
                           for rows in spec.table_sizes], axis=1)
        inputs = [triton.InferInput("dense_features", list(dense.shape), "FP32"),
                  triton.InferInput("sparse_features", list(sparse.shape), "INT64")]
        inputs[0].set_data_from_numpy(dense)
        inputs[1].set_data_from_numpy(sparse.astype(np.int64))
        body, json_size = triton.InferenceServerClient.generate_request_body(inputs)
        bodies.append((body, {"Content-Type": "application/octet-stream",
                              "Inference-Header-Content-Length": str(json_size)}))
    return bodies


def _replicas() -> dict[str, tuple[int, int]]:
    """(target, running) replicas of each pool's deployment."""
    deployments = _get_global_client().get_serve_details()["applications"][APP]["deployments"]
    return {
        name: (deployments[name]["target_num_replicas"],
               sum(replica["state"] == "RUNNING" for replica in deployments[name]["replicas"]))
        for name in (DENSE, SHARD)
    }


def _settled() -> None:
    """Until each pool is back to one running replica (after an earlier test grew one)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while (replicas := _replicas()) != {DENSE: (1, 1), SHARD: (1, 1)}:
        assert time.monotonic() < deadline, f"pools did not settle at one replica each: {replicas}"
        time.sleep(0.5)


def _drive_until_grown(url: str, load: Load, grows: str) -> tuple[dict[str, int], Counter]:
    """Runs ``load`` until Serve asks for more than one ``grows`` replica (at most ``GROWTH_TIMEOUT_S``); the most
    replicas Serve asked for of each pool meanwhile, and the HTTP statuses of the requests."""
    statuses: Counter = Counter()
    lock, stop = threading.Lock(), threading.Event()

    def user(bodies: list[tuple[bytes, dict[str, str]]]) -> None:
        with httpx.Client(timeout=60) as http:
            for body, headers in itertools.cycle(bodies):
                if stop.is_set():
                    return
                status = http.post(url, content=body, headers=headers).status_code
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=user, args=(_bodies(load, seed),)) for seed in range(load.users)]
    most = {DENSE: 1, SHARD: 1}
    deadline = time.monotonic() + GROWTH_TIMEOUT_S
    for thread in threads:
        thread.start()
    try:
        while most[grows] == 1 and time.monotonic() < deadline:
            time.sleep(0.2)
            for name, (target, _) in _replicas().items():
                most[name] = max(most[name], target)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    return most, statuses


def test_a_lookup_heavy_load_grows_the_shard_pool_and_not_the_dense_pool(infer_url):
    _settled()
    most, statuses = _drive_until_grown(infer_url, LOOKUP_HEAVY, grows=SHARD)
    assert most == {SHARD: 2, DENSE: 1}
    assert set(statuses) == {200}, statuses


def test_a_dense_heavy_load_grows_the_dense_pool_and_not_the_shard_pool(infer_url):
    _settled()
    most, statuses = _drive_until_grown(infer_url, DENSE_HEAVY, grows=DENSE)
    assert most == {DENSE: 2, SHARD: 1}
    assert set(statuses) == {200}, statuses
