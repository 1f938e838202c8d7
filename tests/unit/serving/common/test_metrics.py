"""swiftserve's own metrics, recorded into an in-memory sink by the real components running in-process:
the engine loop and backend (steps, rows, ControlNet calls, LoRA cache and waits, request latency), the LoRA
cache, the embedding shard client against loopback servers (RPC latency, failovers) and the DLRM request path."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from disagg.deployments.ingress import BatchedDLRM
from disagg.rpc.client import EmbeddingRequestError, ShardClient, ShardUnavailable
from disagg.rpc.server import EmbeddingServer
from disagg.signature import dlrm_signature
from serving.common.errors import APIError
from serving.common.metrics import (
    ALL_METRICS,
    BATCH_SIZE,
    CONTROLNET_CALL_LATENCY,
    EMBEDDING_FAILOVERS,
    EMBEDDING_RPC_LATENCY,
    LORA_CACHE_BYTES,
    LORA_CACHE_HITS,
    LORA_CACHE_MISSES,
    LORA_WAIT_STEPS,
    NO_METRICS,
    REQUEST_LATENCY,
    STEP_LATENCY,
    InMemorySink,
    Metrics,
    RaySink,
)
from serving.config import DiffusionAppConfig, EngineConfig, LoRAConfig
from serving.controlnet.client import LocalControlNets, MeasuredControlNets
from serving.controlnet.models import build_controlnet_preset
from serving.controlnet.runner import ControlNetRunner
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, LocalBackend, LoRASpec
from serving.engine.types import ControlNetSpec
from serving.lora import LoRACache, LoRALayer, LoRARegistry, LoRAWeights
from serving.presets import build_preset
from tests.helpers.embedding_shards import serving, toy_inputs, toy_shard
from tests.helpers.held_loras import held_loader, release_once_blocked
from tests.helpers.images import square
from tests.helpers.lora_files import write_lora

CPU = torch.device("cpu")
WAIT = 60  # seconds; every wait is bounded so a bug fails instead of hanging


@pytest.fixture
def sink() -> InMemorySink:
    return InMemorySink()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("metrics-loras")
    write_lora(directory / "outlined.safetensors", seed=1, text_encoder=True)
    return directory


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle", width=64, height=64, num_inference_steps=3, guidance_scale=7.5, seed=3)
    return GenerationParams(**{**values, **overrides})


# -- the module itself ------------------------------------------------------------------------------


def test_every_metric_is_prefixed_and_accepted_by_rays_metric_classes():
    names = [metric.name for metric in ALL_METRICS]
    assert len(set(names)) == len(names) and all(name.startswith("swiftserve_") for name in names)
    for metric in ALL_METRICS:
        if metric.kind == "histogram":
            assert metric.boundaries == tuple(sorted(metric.boundaries)) and metric.boundaries[0] > 0
    # Ray's own metric classes check names, tag keys and boundaries (outside a replica records go nowhere).
    ray_sink = RaySink()
    for metric in ALL_METRICS:
        ray_sink.record(metric, 1.0, {key: "x" for key in metric.tag_keys})
    assert ray_sink._failed == set()  # nothing was refused (a refused record is logged and dropped)


def test_in_memory_sink_refuses_what_ray_would_refuse(sink):
    with pytest.raises(ValueError, match="tags"):
        sink.record(BATCH_SIZE, 4, {})  # `kind` missing
    with pytest.raises(ValueError, match="strings"):
        sink.record(EMBEDDING_FAILOVERS, 1, {"shard": 0})
    with pytest.raises(ValueError, match="positive"):
        sink.record(LORA_CACHE_HITS, 0, {})
    NO_METRICS.dlrm_batch(3)  # records nowhere, raises nothing
    assert sink.records(BATCH_SIZE) == []


# -- diffusion ---------------------------------------------------------------------------------------


def test_generations_record_steps_rows_controlnet_calls_lora_cache_and_request_latency(sink, lora_dir):
    metrics = Metrics(sink)
    controlnets = MeasuredControlNets(
        LocalControlNets({"edges": ControlNetRunner(build_controlnet_preset("tiny"), CPU)}), metrics)
    engine = DiffusionEngine("tiny", build_preset("tiny"), CPU, controlnets=controlnets)
    backend = LocalBackend.for_engine(engine, DiffusionAppConfig(lora=LoRAConfig(directory=lora_dir)), metrics=metrics)
    request = dict(loras=(LoRASpec("outlined", 0.8),), controlnets=(ControlNetSpec("edges", square()),))
    try:
        cold = asyncio.run(backend.generate(_params(seed=1, **request)))  # 3 steps, the LoRA loads meanwhile
        warm = asyncio.run(backend.generate(_params(seed=2, **request)))  # 3 steps, the LoRA is cached
        with pytest.raises(APIError):
            asyncio.run(backend.generate(_params(loras=(LoRASpec("missing"),))))
        cache_bytes = backend.loop.lora_cache.stats()["bytes"]
    finally:
        backend.close()

    steps = sink.values(STEP_LATENCY)
    assert len(steps) == 6 and all(0 < ms < 60_000 for ms in steps)  # one record per step run
    assert sink.values(BATCH_SIZE, kind="diffusion_step") == [2] * 6  # one image with CFG: two UNet rows
    calls = sink.values(CONTROLNET_CALL_LATENCY, controlnet="edges")
    assert len(calls) == 6  # one call per step: both rows of a request go in one call
    assert all(0 < call < step for call, step in zip(calls, steps, strict=True))  # a call lies within its step

    assert sink.total(LORA_CACHE_MISSES, load="new") == 1 and sink.total(LORA_CACHE_HITS) == 1
    assert sink.records(LORA_CACHE_MISSES, load="shared") == []
    assert cache_bytes > 0 and sink.last(LORA_CACHE_BYTES) == cache_bytes
    assert cold.lora is not None and warm.lora is not None
    assert sink.values(LORA_WAIT_STEPS) == [cold.lora.applied_at_step, 0]

    latency = sink.records(REQUEST_LATENCY, kind="diffusion_generation")
    assert [record.tags["status"] for record in latency] == ["200", "200", "404"]
    assert latency[0].value >= sum(steps[:3]) and latency[1].value >= sum(steps[3:])  # steps run inside requests


def test_a_cold_lora_reached_at_its_deadline_step_records_the_steps_it_waited(sink, tiny_engine, lora_dir):
    release = threading.Event()

    def on_step(state):
        if state.step_index == 3:  # steps 0-2 ran without the LoRA; step 3 is its deadline (0.5 of 6)
            threading.Thread(target=release_once_blocked, args=(state, release)).start()

    metrics = Metrics(sink)
    cache = LoRACache(LoRARegistry(lora_dir), tiny_engine.lora_targets, budget_bytes=2**30, max_file_bytes=2**30,
                      loader=held_loader(tiny_engine, release), metrics=metrics)
    loop = EngineLoop(tiny_engine, EngineConfig(lora_wait_fraction=0.5), cache, on_step=on_step, metrics=metrics)
    try:
        result = loop.submit(_params(num_inference_steps=6, guidance_scale=1.0,
                                     loras=(LoRASpec("outlined", 1.0),))).result(timeout=WAIT)
    finally:
        loop.stop()
        cache.close()
    assert result.lora is not None and result.lora.applied_at_step == 3
    assert result.lora.wait_s > 0  # it stood still at its deadline step until the load finished
    assert sink.values(LORA_WAIT_STEPS) == [3]
    assert sink.values(BATCH_SIZE, kind="diffusion_step") == [1] * 6  # no CFG: one row per image
    assert len(sink.values(STEP_LATENCY)) == 6
    assert sink.total(LORA_CACHE_MISSES, load="new") == 1


class _SizedLoader:
    """Weights of ``sizes[stem]`` bytes, each load waiting for ``gate``."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes
        self.gate = threading.Event()

    def __call__(self, path: Path) -> LoRAWeights:
        assert self.gate.wait(WAIT)
        layer = LoRALayer(down=torch.zeros(self.sizes[path.stem] // 4), up=torch.zeros(0), scale=1.0)
        return LoRAWeights.build(path.stem, {"m": layer}, {})


def test_lora_cache_records_misses_shared_loads_hits_and_the_bytes_it_holds(sink, tmp_path):
    for name in "ab":
        (tmp_path / f"{name}.safetensors").write_bytes(b"not parsed by the fake loader")
    loader = _SizedLoader({"a": 400, "b": 200})
    cache = LoRACache(LoRARegistry(tmp_path), targets=None, budget_bytes=500, max_file_bytes=10**6, loader=loader,
                      metrics=Metrics(sink))
    try:
        first = cache.get("a")
        assert cache.get("a") is first  # joins the load in flight
        loader.gate.set()
        first.result(WAIT)
        cache.get("a").result(WAIT)  # a hit
        cache.get("b").result(WAIT)  # 600 bytes > 500: "a" is evicted
        stats = cache.stats()
    finally:
        cache.close()
    assert sink.total(LORA_CACHE_MISSES, load="new") == stats["misses"] == 2
    assert sink.total(LORA_CACHE_MISSES, load="shared") == stats["shared_loads"] == 1
    assert sink.total(LORA_CACHE_HITS) == stats["hits"] == 1
    # Set at every lookup and load, in order: empty, empty, "a" loaded, hit, lookup of "b", "b" in and "a" out.
    assert sink.values(LORA_CACHE_BYTES) == [0, 0, 400, 400, 400, 200]
    assert stats["bytes"] == 200 and stats["evictions"] == 1


# -- DLRM ----------------------------------------------------------------------------------------------


async def _dead_address() -> str:
    server = EmbeddingServer(toy_shard())
    await server.start()
    await server.stop(0)
    return server.address


def test_embedding_client_records_rpc_latency_per_shard_and_failovers(sink):
    async def body():
        metrics = Metrics(sink)
        shard = toy_shard()
        async with serving(shard) as alive:
            replicas = ShardClient(0, [await _dead_address(), alive.address], cooldown_s=60, metrics=metrics)
            down = ShardClient(1, [await _dead_address()], metrics=metrics)
            try:
                await replicas.lookup(toy_inputs(shard), timeout_s=5)  # round robin starts at the dead replica
                await replicas.lookup(toy_inputs(shard), timeout_s=5)  # which now cools down: no failover
                with pytest.raises(EmbeddingRequestError):
                    await replicas.lookup({"bogus": torch.tensor([1])}, timeout_s=5)
                with pytest.raises(ShardUnavailable):
                    await down.lookup(toy_inputs(shard), timeout_s=1)
            finally:
                await replicas.close()
                await down.close()
        return replicas, down

    replicas, down = asyncio.run(body())
    assert sink.total(EMBEDDING_FAILOVERS, shard="0") == replicas.stats.failovers == 1
    assert sink.total(EMBEDDING_FAILOVERS, shard="1") == down.stats.failovers == 0
    ok = sink.values(EMBEDDING_RPC_LATENCY, shard="0", method="Lookup", status="ok")
    assert len(ok) == 2 and all(0 < ms < 5_000 for ms in ok)
    assert len(sink.values(EMBEDDING_RPC_LATENCY, shard="0", status="request_error")) == 1
    assert len(sink.values(EMBEDDING_RPC_LATENCY, shard="1", status="unavailable")) == 1
    assert len(sink.records(EMBEDDING_RPC_LATENCY, shard="0")) == replicas.stats.calls == 3


class _Unbatched(BatchedDLRM):
    """``BatchedDLRM``'s request path with ``@serve.batch`` (which needs a Serve replica) bypassed: each request is
    a batch of one, run by the undecorated batch method; the model answers 0.5 per row, or raises ``error``."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.signature = dlrm_signature(num_dense=13, num_tables=26)
        self.error: BaseException | None = None
        self.gate: asyncio.Event | None = None

    async def _infer_batch(self, request):
        return (await BatchedDLRM._infer_batch.__wrapped__(self, [request]))[0]

    async def _forward_batch(self, inputs):
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return torch.full((inputs["dense"].shape[0], 1), 0.5)


def _dlrm_request(rows: int) -> dict[str, torch.Tensor]:
    return {"dense": torch.rand(rows, 13), "sparse": torch.zeros(rows, 26, 1, dtype=torch.int64)}


def test_dlrm_requests_record_latency_with_status_and_batches_their_rows(sink):
    async def body():
        replica = _Unbatched(Metrics(sink))
        assert [output.shape for output in await replica.infer(_dlrm_request(3))] == [(3, 1)]
        merged = await BatchedDLRM._infer_batch.__wrapped__(replica, [_dlrm_request(4), _dlrm_request(5)])
        assert [outputs[0].shape[0] for outputs in merged] == [4, 5]
        replica.error = APIError(503, "embedding shard 1 is unavailable, retry later")
        with pytest.raises(APIError):
            await replica.infer(_dlrm_request(2))
        replica.error = RuntimeError("bug")
        with pytest.raises(RuntimeError):
            await replica.infer(_dlrm_request(1))
        replica.error, replica.gate = None, asyncio.Event()
        waiting = asyncio.ensure_future(replica.infer(_dlrm_request(1)))
        await asyncio.sleep(0.05)
        waiting.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(body())
    assert sink.values(BATCH_SIZE, kind="dlrm_batch") == [3, 9, 2, 1, 1]
    latency = sink.records(REQUEST_LATENCY, kind="dlrm_infer")
    assert [record.tags["status"] for record in latency] == ["200", "503", "500", "cancelled"]
    assert all(record.value > 0 for record in latency)
    assert latency[-1].value >= 50  # it waited in its batch until cancelled
