"""swiftserve's own metrics, exported on Ray's Prometheus endpoint next to Ray Serve's.

Code records through a ``Metrics`` object, one method per event; its sink decides where the values go: ``RaySink``
(``Metrics.for_replica()``, in a replica's constructor), ``InMemorySink`` (tests) or none (``NO_METRICS``, every
component's default: nothing recorded). The metrics and their tags: docs/ARCHITECTURE.md, "Metrics".
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from serving.common.logging import get_logger

logger = get_logger("metrics")

MetricKind = Literal["counter", "gauge", "histogram"]
RequestKind = Literal["diffusion_generation", "dlrm_infer"]
LoRALookup = Literal["hit", "new", "shared"]
RPCStatus = Literal["ok", "request_error", "unavailable", "version_mismatch"]
CacheOutcome = Literal["hit", "miss"]
RemotePath = Literal["cfg", "controlnet"]
Direction = Literal["sent", "received"]
BandOutcome = Literal["split", "fallback"]
CancelStage = Literal["queued", "denoising", "decoding"]

#: Bucket upper bounds (ms) for whole requests: a DLRM batch in milliseconds, an image in seconds to minutes.
REQUEST_LATENCY_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 60_000, 120_000)
#: Bucket upper bounds (ms) for one step, one ControlNet call, one gRPC lookup.
CALL_LATENCY_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000)
BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1_024, 2_048, 4_096)
#: Steps are integers: the 0.5 bucket holds exactly the requests whose LoRAs applied from their first step.
LORA_STEPS = (0.5, 1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class MetricSpec:
    """One metric: Prometheus name (before Ray's ``ray_`` prefix), type, help text, tag keys, buckets."""

    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


REQUEST_LATENCY = MetricSpec(
    "swiftserve_request_latency_ms", "histogram",
    "One request in the model replica, from its arrival to its result (queueing, batching and compute); "
    "kind: diffusion_generation or dlrm_infer; status: 200, the HTTP status of an API error, 500 for "
    "anything else, or cancelled.",
    ("kind", "status"), REQUEST_LATENCY_MS,
)
CANCELLED_REQUESTS = MetricSpec(
    "swiftserve_cancelled_requests", "counter",
    "Diffusion requests whose caller went away, by where the engine dropped them: queued (never admitted: its "
    "preparation cancelled if not begun), denoising (its rows freed at the next step boundary) or decoding "
    "(denoised; its decode skipped, or its result dropped when the decode had begun).",
    ("stage",),
)
STEP_LATENCY = MetricSpec(
    "swiftserve_diffusion_step_latency_ms", "histogram",
    "One denoising step of the engine loop: one denoiser forward over every row of the batch, with its "
    "ControlNet calls, CFG worker call and scheduler steps.",
    (), CALL_LATENCY_MS,
)
BATCH_SIZE = MetricSpec(
    "swiftserve_batch_rows", "histogram",
    "Rows per batch; kind=diffusion_step: denoiser rows of one denoising step (an image with classifier-free "
    "guidance is two rows); kind=dlrm_batch: samples of one merged DLRM batch.",
    ("kind",), BATCH_ROWS,
)
LORA_CACHE_HITS = MetricSpec(
    "swiftserve_lora_cache_hits", "counter", "LoRA lookups answered from the host-memory cache.",
)
LORA_CACHE_MISSES = MetricSpec(
    "swiftserve_lora_cache_misses", "counter",
    "LoRA lookups that did not find it in memory; load=new started a read, load=shared joined one in flight.",
    ("load",),
)
LORA_CACHE_BYTES = MetricSpec(
    "swiftserve_lora_cache_bytes", "gauge", "Bytes of LoRA weights held by the host-memory cache.",
)
LORA_WAIT_STEPS = MetricSpec(
    "swiftserve_lora_wait_steps", "histogram",
    "Denoising steps a request ran before its LoRAs were applied (0: they were ready at its first step).",
    (), LORA_STEPS,
)
CONTROLNET_CALL_LATENCY = MetricSpec(
    "swiftserve_controlnet_call_latency_ms", "histogram",
    "One ControlNet call of one step, seen by the engine: from sending it until its residuals are in hand. "
    "The engine asks for them after its own UNet down blocks, so this is at least their time.",
    ("controlnet",), CALL_LATENCY_MS,
)
CFG_LOCAL_FALLBACKS = MetricSpec(
    "swiftserve_cfg_local_fallbacks", "counter",
    "Denoising steps whose unconditional rows the model replica computed itself because the CFG worker failed or "
    "was late, or was pausing after such a failure.",
)
CFG_LORA_LOCAL_ROWS = MetricSpec(
    "swiftserve_cfg_lora_local_rows", "counter",
    "Unconditional rows the model replica computed itself because the CFG worker had not finished loading their "
    "LoRAs (the worker computed the step's other rows).",
)
BAND_DECODES = MetricSpec(
    "swiftserve_band_decodes", "counter",
    "VAE decodes split into two row bands, the lower one on the CFG worker's device (`split`), and those the "
    "replica decoded whole because the worker failed (`fallback`).",
    ("outcome",),
)
REMOTE_BYTES = MetricSpec(
    "swiftserve_remote_bytes", "counter",
    "Bytes a replica's denoising steps moved to and from other replicas; path: cfg (the CFG worker) or "
    "controlnet (ControlNet services); direction=sent: step arrays and new object-store puts (a request's text "
    "embeddings and conditioning images, once each), received: noise or residuals.",
    ("path", "direction"),
)
EMBEDDING_RPC_LATENCY = MetricSpec(
    "swiftserve_embedding_rpc_latency_ms", "histogram",
    "One gRPC call to an embedding shard, failovers to its other replicas included; "
    "status: ok, request_error, unavailable or version_mismatch (no replica serves the table version this dense "
    "replica expects).",
    ("shard", "method", "status"), CALL_LATENCY_MS,
)
EMBEDDING_FAILOVERS = MetricSpec(
    "swiftserve_embedding_failovers", "counter",
    "Embedding calls retried on another replica of the shard after one failed.",
    ("shard",),
)
EMBEDDING_CACHE_LOOKUPS = MetricSpec(
    "swiftserve_embedding_cache_lookups", "counter",
    "Unique ids of a batch looked up in a dense replica's hot-embedding cache; outcome=hit skipped the shard RPC "
    "for that id, outcome=miss went to a shard. Hit rate: hit / (hit + miss).",
    ("outcome",),
)
EMBEDDING_BYTES = MetricSpec(
    "swiftserve_embedding_bytes", "counter",
    "Serialized bytes of a dense replica's answered embedding lookups; direction: sent (ids) or received (rows).",
    ("direction",),
)

ALL_METRICS = (
    REQUEST_LATENCY, CANCELLED_REQUESTS, STEP_LATENCY, BATCH_SIZE, LORA_CACHE_HITS, LORA_CACHE_MISSES, LORA_CACHE_BYTES,
    LORA_WAIT_STEPS, CONTROLNET_CALL_LATENCY, CFG_LOCAL_FALLBACKS, CFG_LORA_LOCAL_ROWS, BAND_DECODES, REMOTE_BYTES,
    EMBEDDING_RPC_LATENCY, EMBEDDING_FAILOVERS, EMBEDDING_CACHE_LOOKUPS, EMBEDDING_BYTES,
)


class MetricsSink(Protocol):
    def record(self, metric: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        """Counter: add ``value`` (> 0); gauge: set it; histogram: observe it. ``tags`` has every tag key."""


def check_record(metric: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
    """Raises ``ValueError`` for a record Ray would refuse: other tag keys than declared, non-string tag values,
    a counter increment that is not positive."""
    if set(tags) != set(metric.tag_keys):
        raise ValueError(f"{metric.name}: tags {sorted(tags)} != declared {sorted(metric.tag_keys)}")
    if not all(isinstance(tag, str) for tag in tags.values()):
        raise ValueError(f"{metric.name}: tag values must be strings, got {dict(tags)}")
    if metric.kind == "counter" and value <= 0:
        raise ValueError(f"{metric.name}: a counter increment must be positive, got {value}")


class Metrics:
    """What swiftserve records, as one method per event. ``Metrics()`` records nothing."""

    def __init__(self, sink: MetricsSink | None = None) -> None:
        self._sink = sink

    @classmethod
    def for_replica(cls) -> Metrics:
        """Metrics exported through Ray (call inside the replica, e.g. in the deployment's constructor)."""
        return cls(RaySink())

    @contextmanager
    def request(self, kind: RequestKind) -> Iterator[None]:
        """Times the block as one request of ``kind``; its status comes from how the block ends (``cancelled``: the
        awaiting task was cancelled, or a streaming generator closed early)."""
        started = time.perf_counter()
        status = "500"
        try:
            yield
            status = "200"
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        except Exception as exc:
            status = str(getattr(exc, "status_code", 500))  # an APIError answers with its own status
            raise
        finally:
            self._record(REQUEST_LATENCY, _ms_since(started), kind=kind, status=status)

    def request_cancelled(self, stage: CancelStage) -> None:
        self._record(CANCELLED_REQUESTS, 1, stage=stage)

    def diffusion_step(self, seconds: float, rows: int) -> None:
        self._record(STEP_LATENCY, seconds * 1e3)
        self._record(BATCH_SIZE, rows, kind="diffusion_step")

    def dlrm_batch(self, rows: int) -> None:
        self._record(BATCH_SIZE, rows, kind="dlrm_batch")

    def lora_lookup(self, outcome: LoRALookup) -> None:
        if outcome == "hit":
            self._record(LORA_CACHE_HITS, 1)
        else:
            self._record(LORA_CACHE_MISSES, 1, load=outcome)

    def lora_cache_bytes(self, nbytes: int) -> None:
        self._record(LORA_CACHE_BYTES, nbytes)

    def lora_wait_steps(self, steps: int) -> None:
        self._record(LORA_WAIT_STEPS, steps)

    def controlnet_call(self, name: str, seconds: float) -> None:
        self._record(CONTROLNET_CALL_LATENCY, seconds * 1e3, controlnet=name)

    def cfg_local_fallback(self) -> None:
        self._record(CFG_LOCAL_FALLBACKS, 1)

    def cfg_lora_local_rows(self, rows: int) -> None:
        self._record(CFG_LORA_LOCAL_ROWS, rows)

    def band_decode(self, outcome: BandOutcome) -> None:
        self._record(BAND_DECODES, 1, outcome=outcome)

    def remote_bytes(self, path: RemotePath, direction: Direction, nbytes: int) -> None:
        if nbytes > 0:
            self._record(REMOTE_BYTES, nbytes, path=path, direction=direction)

    def embedding_rpc(self, shard: int, method: str, status: RPCStatus, seconds: float) -> None:
        self._record(EMBEDDING_RPC_LATENCY, seconds * 1e3, shard=str(shard), method=method, status=status)

    def embedding_failover(self, shard: int) -> None:
        self._record(EMBEDDING_FAILOVERS, 1, shard=str(shard))

    def embedding_cache(self, hits: int, misses: int) -> None:
        for outcome, count in (("hit", hits), ("miss", misses)):
            if count > 0:
                self._record(EMBEDDING_CACHE_LOOKUPS, count, outcome=outcome)

    def embedding_bytes(self, direction: Direction, nbytes: int) -> None:
        if nbytes > 0:
            self._record(EMBEDDING_BYTES, nbytes, direction=direction)

    def _record(self, metric: MetricSpec, value: float, **tags: str) -> None:
        if self._sink is not None:
            self._sink.record(metric, float(value), tags)


#: Records nothing: the default wherever a component takes a ``Metrics``.
NO_METRICS = Metrics()


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1e3


class RaySink:
    """Records into ``ray.serve.metrics`` objects, one per metric and process, created on first record.

    A failing record is logged (once per metric) and dropped: metrics never fail a request.
    """

    def __init__(self) -> None:
        self._failed: set[str] = set()

    def record(self, metric: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        try:
            target = _ray_metric(metric)
            if metric.kind == "counter":
                target.inc(value, dict(tags))
            elif metric.kind == "gauge":
                target.set(value, dict(tags))
            else:
                target.observe(value, dict(tags))
        except Exception:
            if metric.name not in self._failed:
                self._failed.add(metric.name)
                logger.warning("recording metric %s failed; dropping its records", metric.name, exc_info=True)


_ray_metrics: dict[str, Any] = {}  # the process's Ray metric objects, by name, created on first record
_ray_metrics_lock = threading.Lock()


def _ray_metric(metric: MetricSpec) -> Any:
    with _ray_metrics_lock:
        found = _ray_metrics.get(metric.name)
        if found is None:
            from ray.serve import metrics as serve_metrics  # here: importing this module must not need Ray

            if metric.kind == "histogram":
                found = serve_metrics.Histogram(metric.name, description=metric.description,
                                                boundaries=list(metric.boundaries), tag_keys=metric.tag_keys)
            else:
                cls = serve_metrics.Counter if metric.kind == "counter" else serve_metrics.Gauge
                found = cls(metric.name, description=metric.description, tag_keys=metric.tag_keys)
            _ray_metrics[metric.name] = found
        return found


@dataclass(frozen=True)
class Record:
    metric: str
    value: float
    tags: dict[str, str]


class InMemorySink:
    """Keeps every record (thread-safe), checked with ``check_record``; for tests."""

    def __init__(self) -> None:
        self._records: list[Record] = []
        self._lock = threading.Lock()

    def record(self, metric: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        check_record(metric, value, tags)
        with self._lock:
            self._records.append(Record(metric.name, value, dict(tags)))

    def records(self, metric: MetricSpec, **tags: str) -> list[Record]:
        """``metric``'s records, in order, whose tags include ``tags``."""
        with self._lock:
            return [r for r in self._records
                    if r.metric == metric.name and all(r.tags.get(k) == v for k, v in tags.items())]

    def values(self, metric: MetricSpec, **tags: str) -> list[float]:
        return [record.value for record in self.records(metric, **tags)]

    def total(self, metric: MetricSpec, **tags: str) -> float:
        """A counter's value (the sum of its increments) over the matching tags."""
        return sum(self.values(metric, **tags))

    def last(self, metric: MetricSpec, **tags: str) -> float | None:
        """A gauge's current value, or None if never set."""
        values = self.values(metric, **tags)
        return values[-1] if values else None
