"""swiftserve's own metrics on Ray's Prometheus endpoints, after real traffic to the session cluster's apps.

Every node's metrics agent serves the metrics of the processes on that node at
``http://<NodeManagerAddress>:<MetricsExportPort>/metrics`` (both from ``ray.nodes()``); the replicas of the
session cluster are spread over three nodes (head, CPU pool, GPU pool), so every alive node is scraped. Ray
prefixes application metrics with ``ray_`` and exports what workers recorded every ``metrics_report_interval_ms``
(10 s by default), keeping a gauge only for two such intervals after its last report: traffic therefore keeps
flowing while the test polls, as on a live server, until every metric was seen non-zero or the deadline passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from disagg.api.codec import encode_infer_request
from disagg.spec import preset_spec
from disagg.synthetic import SyntheticRequests
from serving.common.metrics import (
    ALL_METRICS,
    BAND_DECODES,
    BATCH_SIZE,
    CANCELLED_REQUESTS,
    CFG_LOCAL_FALLBACKS,
    CFG_LORA_LOCAL_ROWS,
    CONTROLNET_CALL_LATENCY,
    EMBEDDING_BYTES,
    EMBEDDING_CACHE_LOOKUPS,
    EMBEDDING_FAILOVERS,
    EMBEDDING_RPC_LATENCY,
    LORA_CACHE_BYTES,
    LORA_CACHE_HITS,
    LORA_CACHE_MISSES,
    LORA_WAIT_STEPS,
    REMOTE_BYTES,
    REQUEST_LATENCY,
    STEP_LATENCY,
    MetricSpec,
)
from tests.helpers.images import encode_b64, square
from tests.helpers.lora_files import write_lora
from tests.helpers.prometheus import metric_value, scrape
from tests.helpers.replicas import kill_replica, named_replicas
from tests.integration.conftest import DEFAULT_MODEL

pytestmark = pytest.mark.integration

DEADLINE_S = 120.0  # two report intervals at Ray's default, plus traffic on a slow machine
PROBE_LORA = "metrics-probe"  # used by no other test: its first request is a cache miss whatever ran before

#: (metric, labels a non-zero sample must carry): what the traffic below must make every replica record.
EXPECTED: list[tuple[MetricSpec, dict[str, str]]] = [
    (REQUEST_LATENCY, {"application": "diffusion", "kind": "diffusion_generation", "status": "200"}),
    (REQUEST_LATENCY, {"application": "dlrm", "kind": "dlrm_infer", "status": "200"}),
    (STEP_LATENCY, {"application": "diffusion", "deployment": f"DiffusionModel_{DEFAULT_MODEL}"}),
    (BATCH_SIZE, {"application": "diffusion", "kind": "diffusion_step"}),
    (BATCH_SIZE, {"application": "dlrm", "kind": "dlrm_batch"}),
    (LORA_CACHE_HITS, {"application": "diffusion"}),
    (LORA_CACHE_MISSES, {"application": "diffusion", "load": "new"}),
    (LORA_CACHE_BYTES, {"application": "diffusion"}),
    (LORA_WAIT_STEPS, {"application": "diffusion"}),
    (CONTROLNET_CALL_LATENCY, {"application": "diffusion", "controlnet": "edges"}),
    (REMOTE_BYTES, {"application": "diffusion", "path": "controlnet", "direction": "sent"}),
    (REMOTE_BYTES, {"application": "diffusion", "path": "controlnet", "direction": "received"}),
    (REMOTE_BYTES, {"application": "diffusion-cfg", "path": "cfg", "direction": "sent"}),
    (REMOTE_BYTES, {"application": "diffusion-cfg", "path": "cfg", "direction": "received"}),
    (BAND_DECODES, {"application": "diffusion-cfg", "outcome": "split"}),  # the worker decoded the lower band
    (EMBEDDING_RPC_LATENCY, {"application": "dlrm", "shard": "0", "method": "Lookup", "status": "ok"}),
    (EMBEDDING_RPC_LATENCY, {"application": "dlrm", "shard": "1", "method": "Lookup", "status": "ok"}),
    (EMBEDDING_BYTES, {"application": "dlrm", "direction": "sent"}),
    (EMBEDDING_BYTES, {"application": "dlrm", "direction": "received"}),
    (EMBEDDING_CACHE_LOOKUPS, {"application": "dlrm-secure", "outcome": "miss"}),  # the app with a cache
    (EMBEDDING_CACHE_LOOKUPS, {"application": "dlrm-secure", "outcome": "hit"}),
]


@pytest.fixture(scope="module")
def probe_lora(lora_dir: Path) -> Iterator[str]:
    """A LoRA only this module uses; removed afterwards, so `/v1/models` lists what the other tests expect."""
    path = write_lora(lora_dir / f"{PROBE_LORA}.safetensors", seed=7)
    try:
        yield PROBE_LORA
    finally:
        path.unlink(missing_ok=True)


def _dlrm_body(seed: int) -> dict:
    dense, sparse = SyntheticRequests(preset_spec("tiny"), seed=seed, max_hotness=2).batch(4)
    return encode_infer_request({"dense_features": dense, "sparse_features": sparse}).model_dump()


def _send_traffic(http: httpx.Client, lora: str, seed: int) -> None:
    """One generation with a ControlNet and a LoRA, one guided generation on the parallel-CFG app, and one DLRM
    inference on each disaggregated app (the plain one and the secured one with a cache)."""
    image = {"prompt": "a square", "size": "64x64", "num_inference_steps": 2, "seed": seed,
             "controlnets": [{"name": "edges", "image": encode_b64(square())}],
             "loras": [{"name": lora, "scale": 0.8}]}
    response = http.post("/v1/images/generations", json=image)
    assert response.status_code == 200, response.text
    guided = {"prompt": "a square", "size": "64x64", "num_inference_steps": 2, "seed": seed, "guidance_scale": 5.0}
    response = http.post("/cfg/v1/images/generations", json=guided)
    assert response.status_code == 200, response.text
    for prefix in ("/v2", "/secure/v2"):
        response = http.post(f"{prefix}/models/dlrm/infer", json=_dlrm_body(seed))
        assert response.status_code == 200, response.text


def test_every_swiftserve_metric_is_exported_non_zero_after_traffic(http, probe_lora):
    # failovers and CFG fallbacks need a replica killed: the two tests below; CFG rows left for a LoRA still loading
    # on the worker need a load slower than the replica's (the unit tests hold one back)
    # cancellations need a client that goes away: test_images_streaming.py
    assert {metric for metric, _ in EXPECTED} == set(ALL_METRICS) - {
        EMBEDDING_FAILOVERS, CFG_LOCAL_FALLBACKS, CFG_LORA_LOCAL_ROWS, CANCELLED_REQUESTS}
    missing = list(EXPECTED)
    deadline = time.monotonic() + DEADLINE_S
    seed = 0
    while missing:
        _send_traffic(http, probe_lora, seed)  # the first is a LoRA miss, the next ones hits
        seed += 1
        samples = scrape()
        missing = [(metric, labels) for metric, labels in missing if metric_value(samples, metric, labels) <= 0]
        if missing and time.monotonic() > deadline:
            found = {name: [(s.labels, s.value) for s in group] for name, group in samples.items()}
            pytest.fail(f"not exported non-zero within {DEADLINE_S:.0f} s: "
                        f"{[(m.name, labels) for m, labels in missing]}; swiftserve samples: {found}")
        time.sleep(1.0)


def test_a_killed_shard_replica_is_counted_as_embedding_failovers(http):
    shard = {"application": "dlrm", "shard": "0"}
    deadline = time.monotonic() + DEADLINE_S
    while len(named_replicas("dlrm", "EmbeddingShard_0")) < 2:  # replaced replicas of earlier tests are up
        assert time.monotonic() < deadline, "shard 0 has not two replicas"
        time.sleep(1.0)
    time.sleep(3.0)  # the dense replica has both addresses (announced every discovery period)
    before = metric_value(scrape(), EMBEDDING_FAILOVERS, shard)

    statuses: list[int] = []
    stop = threading.Event()

    def stream() -> None:
        seed = 0
        while not stop.is_set():
            statuses.append(http.post("/v2/models/dlrm/infer", json=_dlrm_body(seed)).status_code)
            seed += 1

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        time.sleep(1.0)
        kill_replica(named_replicas("dlrm", "EmbeddingShard_0")[0])
        time.sleep(3.0)  # lookups keep reaching the dead replica's address until the directory drops it
    finally:
        stop.set()
        thread.join(timeout=60)
    assert statuses, "no request was sent"

    deadline = time.monotonic() + DEADLINE_S
    while (after := metric_value(scrape(), EMBEDDING_FAILOVERS, shard)) <= before:
        assert time.monotonic() < deadline, f"failovers stayed at {after} (statuses {sorted(set(statuses))})"
        time.sleep(1.0)


def test_a_killed_cfg_worker_leaves_its_rows_to_the_model_replicas(http):
    """Guided requests to the parallel-CFG app while its CFGWorker replica is killed: every one is answered 200 (the
    model replicas compute the unconditional rows themselves until the replacement answers), and it is counted."""
    app = {"application": "diffusion-cfg"}
    before = metric_value(scrape(), CFG_LOCAL_FALLBACKS, app)
    body = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 6, "guidance_scale": 5.0}
    statuses: list[int] = []
    stop = threading.Event()

    def stream(first_seed: int) -> None:
        seed = first_seed
        while not stop.is_set():
            statuses.append(http.post("/cfg/v1/images/generations", json=body | {"seed": seed}).status_code)
            seed += 2

    threads = [threading.Thread(target=stream, args=(first,)) for first in range(2)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2.0)  # both base replicas are stepping guided requests with the worker
        kill_replica(named_replicas("diffusion-cfg", f"CFGWorker_{DEFAULT_MODEL}")[0])
        time.sleep(3.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))

    deadline = time.monotonic() + DEADLINE_S
    while (after := metric_value(scrape(), CFG_LOCAL_FALLBACKS, app)) <= before:
        assert time.monotonic() < deadline, f"CFG fallbacks stayed at {after}"
        time.sleep(1.0)

