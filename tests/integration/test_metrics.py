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
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ray import serve

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
from tests.helpers.replicas import (
    kill_replica,
    named_replicas,
    ongoing_requests,
    running_replicas,
)
from tests.helpers.waiting import wait_for
from tests.integration.conftest import DEFAULT_MODEL

pytestmark = pytest.mark.integration

DEADLINE_S = 120.0  # two report intervals at Ray's default, plus traffic on a slow machine
POLL = {"timeout_s": DEADLINE_S, "period_s": 1.0}
DENSE = "DisaggregatedDLRM"
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
    seeds = iter(range(1_000_000))
    samples: dict = {}

    def all_exported() -> bool:
        nonlocal missing, samples
        _send_traffic(http, probe_lora, next(seeds))  # the first is a LoRA miss, the next ones hits
        samples = scrape()
        missing = [(metric, labels) for metric, labels in missing if metric_value(samples, metric, labels) <= 0]
        return not missing

    def failure() -> str:
        found = {name: [(s.labels, s.value) for s in group] for name, group in samples.items()}
        return (f"not exported non-zero within {DEADLINE_S:.0f} s: {[(m.name, labels) for m, labels in missing]}; "
                f"swiftserve samples: {found}")

    wait_for(all_exported, failure, **POLL)


class _Traffic:
    """Requests sent on threads of their own until stopped; their statuses kept."""

    def __init__(self, send, threads: int) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(send, first, threads)) for first in range(threads)]

    def _run(self, send, seed: int, step: int) -> None:
        while not self._stop.is_set():
            self.statuses.append(send(seed))
            seed += step

    def __enter__(self) -> _Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def test_a_killed_shard_replica_is_counted_as_embedding_failovers(http):
    shard = {"application": "dlrm", "shard": "0"}
    wait_for(lambda: len(running_replicas("dlrm", "EmbeddingShard_0")) == 2,  # replacements of earlier tests are up
             "shard 0 has not two running replicas", **POLL)

    assert len(running_replicas("dlrm", DENSE)) == 1  # the session's config: what the handle reaches is all of them
    dense = serve.get_deployment_handle(DENSE, app_name="dlrm")
    wait_for(lambda: len(dense.shard_addresses.remote().result(timeout_s=60)[0]) == 2,  # announced every period
             "the dense replica does not know both replicas of shard 0", **POLL)
    before = metric_value(scrape(), EMBEDDING_FAILOVERS, shard)

    def send(seed: int) -> int:
        return http.post("/v2/models/dlrm/infer", json=_dlrm_body(seed)).status_code

    with _Traffic(send, threads=1) as traffic:
        wait_for(lambda: traffic.statuses, "no request was answered", **POLL)
        kill_replica(named_replicas("dlrm", "EmbeddingShard_0")[0])
        # lookups keep reaching the dead replica's address until the directory drops it: counted as failovers
        wait_for(lambda: metric_value(scrape(), EMBEDDING_FAILOVERS, shard) > before,
                 lambda: f"failovers stayed at {before} (statuses {sorted(set(traffic.statuses))})", **POLL)


def test_a_killed_cfg_worker_leaves_its_rows_to_the_model_replicas(http):
    """Guided requests to the parallel-CFG app while its CFGWorker replica is killed: every one is answered 200 (the
    model replicas compute the unconditional rows themselves until the replacement answers), and it is counted."""
    app = {"application": "diffusion-cfg"}
    before = metric_value(scrape(), CFG_LOCAL_FALLBACKS, app)
    body = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 6, "guidance_scale": 5.0}
    (worker,) = running_replicas("diffusion-cfg", f"CFGWorker_{DEFAULT_MODEL}")

    def send(seed: int) -> int:
        return http.post("/cfg/v1/images/generations", json=body | {"seed": seed}).status_code

    with _Traffic(send, threads=2) as traffic:
        wait_for(lambda: ongoing_requests(worker) > 0, "no guided step reached the CFG worker",
                 timeout_s=DEADLINE_S, period_s=0.05)
        kill_replica(worker)
        wait_for(lambda: metric_value(scrape(), CFG_LOCAL_FALLBACKS, app) > before,
                 f"CFG fallbacks stayed at {before}", **POLL)
    assert traffic.statuses and set(traffic.statuses) == {200}, sorted(set(traffic.statuses))
