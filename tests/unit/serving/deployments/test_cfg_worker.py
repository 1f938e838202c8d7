"""The parallel-CFG wire path in one process (fake handles and object store, no Ray): the worker merging calls of
several model replicas, rows whose LoRAs are still loading on the worker left to the replica, a request's text
embeddings sent once, and the bytes each step moves."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from serving.common.metrics import (
    BAND_DECODES,
    CFG_LOCAL_FALLBACKS,
    CFG_LORA_LOCAL_ROWS,
    NO_METRICS,
    REMOTE_BYTES,
    InMemorySink,
    Metrics,
)
from serving.config import EngineConfig
from serving.deployments.batching import forward_by_shape
from serving.deployments.cfg_worker import CFGWorkerCore, ServeCFGWorker
from serving.deployments.transport import ResolvedTensors
from serving.engine import DiffusionEngine, EngineLoop, GenerationParams, LoRASpec
from serving.engine.request import RequestState
from serving.engine.rows import RowBatch
from serving.lora import LoRACache, LoRARegistry
from serving.presets import build_preset
from tests.helpers.denoising import denoise_together, loaded_lora
from tests.helpers.fake_serve import FakeHandle, FakeQueue, FakeStore, FakeStreamMethod
from tests.helpers.held_loras import TIMEOUT_S, held_loader
from tests.helpers.lora_files import write_lora

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # images in [0, 1], as the engine's other equivalence tests
LORA = "style"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("cfg-worker-loras")
    write_lora(directory / f"{LORA}.safetensors", seed=4, text_encoder=True)
    return directory


def _engine(**kwargs) -> DiffusionEngine:
    return DiffusionEngine("tiny", build_preset("tiny"), CPU, **kwargs)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle", width=64, height=64, num_inference_steps=2, guidance_scale=7.5, seed=1)
    return GenerationParams(**{**values, **overrides})


def _cache(engine: DiffusionEngine, lora_dir: Path, **kwargs) -> LoRACache:
    return LoRACache(LoRARegistry(lora_dir), engine.lora_targets, budget_bytes=2**30, max_file_bytes=2**30, **kwargs)


def _worker(core: CFGWorkerCore, store: FakeStore,
            metrics: Metrics = NO_METRICS) -> tuple[ServeCFGWorker, FakeHandle]:
    """A model replica's client of ``core``, each call answered at once (a band decode streamed)."""
    handle = FakeHandle(predict=lambda wire: core.forward([wire])[0], prefetch=core.prefetch,
                        decode_band=FakeStreamMethod(lambda session, latents, queue: core.band_steps(
                            session, latents, queue, TIMEOUT_S)))
    return ServeCFGWorker(handle, 30.0, metrics, put=store.put, band_queue=FakeQueue), handle


def _denoise(engine: DiffusionEngine, requests: Sequence[tuple[GenerationParams, bool]],
             lora_dir: Path) -> list[np.ndarray]:
    """The requests (each with the LoRA applied from its first step, or not) stepped as one batch to the end."""
    path = lora_dir / f"{LORA}.safetensors"
    return denoise_together(engine, [(params, [loaded_lora(engine, path)] if with_lora else [])
                                     for params, with_lora in requests])


def _assert_images_close(ours: list[np.ndarray], expected: list[np.ndarray]) -> None:
    for image, reference in zip(ours, expected, strict=True):
        assert np.abs(image - reference).max() <= TOLERANCE


def test_calls_from_two_replicas_share_one_forward_and_each_gets_its_own_rows():
    store = FakeStore()
    core = CFGWorkerCore(_engine(), None, ResolvedTensors(get=store.get))
    forwards: list[int] = []
    predict = core.engine.predict_noise
    core.engine.predict_noise = lambda batch: forwards.append(batch.rows) or predict(batch)
    replica = _engine()
    wires = []
    for seed, side, n in ((1, 64, 1), (2, 64, 2), (3, 32, 1)):  # two replicas' calls of one latent size, one other
        state = replica.start(_params(seed=seed, width=side, height=side, n=n))
        worker, handle = _worker(core, store)
        handle.predict = FakeHandle(predict=lambda wire: None).predict  # record the call only
        worker.submit(RowBatch.for_states([state]).select(range(n)))  # the unconditional rows
        wires.append(handle.predict.calls[0][0])

    answers = asyncio.run(forward_by_shape(wires, lambda wire: wire.sample.shape[1:], core.forward))

    assert forwards == [3, 1]  # the 64 px rows of both replicas in one forward, the 32 px row in its own
    for wire, answer in zip(wires, answers, strict=True):
        alone = core.forward([wire])[0]
        assert answer.skipped == [] and answer.noise.shape[0] == wire.rows
        np.testing.assert_allclose(answer.noise, alone.noise, rtol=1e-4, atol=1e-5)


def test_rows_whose_lora_is_still_loading_on_the_worker_are_computed_by_the_replica(lora_dir):
    """A LoRA request and a plain one stepped together: while the worker's load of the LoRA is held back, it
    computes the plain request's unconditional row and skips the other, which the replica computes (counted);
    once loaded there, the worker computes both. The images are those of one engine alone either way."""
    release = threading.Event()
    worker_engine = _engine()
    cache = _cache(worker_engine, lora_dir, loader=held_loader(worker_engine, release))
    store, sink = FakeStore(), InMemorySink()
    worker, handle = _worker(CFGWorkerCore(worker_engine, cache, ResolvedTensors(get=store.get)), store)
    engine = _engine(cfg_worker=worker, metrics=Metrics(sink))
    requests = [(_params(seed=1), True), (_params(seed=2, negative_prompt="green"), False)]
    expected = _denoise(_engine(), requests, lora_dir)
    try:
        _assert_images_close(_denoise(engine, requests, lora_dir), expected)
        assert [answer.skipped for answer in handle.predict.answers] == [[0], [0]]
        assert sink.total(CFG_LORA_LOCAL_ROWS) == 2 and sink.total(CFG_LOCAL_FALLBACKS) == 0

        release.set()
        cache.get(LORA).result(timeout=TIMEOUT_S)
        _assert_images_close(_denoise(engine, requests, lora_dir), expected)
        assert [answer.skipped for answer in handle.predict.answers[2:]] == [[], []]
        assert sink.total(CFG_LORA_LOCAL_ROWS) == 2
    finally:
        release.set()
        cache.close()


def test_a_request_with_loras_starts_their_load_on_the_worker_when_it_arrives(lora_dir):
    release = threading.Event()
    worker_engine = _engine()
    worker_cache = _cache(worker_engine, lora_dir, loader=held_loader(worker_engine, release))
    store = FakeStore()
    worker, handle = _worker(CFGWorkerCore(worker_engine, worker_cache, ResolvedTensors(get=store.get)), store)
    engine = _engine(cfg_worker=worker)
    loop = EngineLoop(engine, EngineConfig(), _cache(engine, lora_dir))
    try:
        result = loop.submit(_params(loras=(LoRASpec(LORA, 0.8),), lora_mode="exact"))
        assert handle.prefetch.calls == [([LORA],)]
        assert worker_cache.stats()["loading"] == 1  # started before any step of the request
        release.set()
        assert len(result.result(timeout=TIMEOUT_S).images) == 1
        assert not loop.submit(_params(seed=2)).result(timeout=TIMEOUT_S).lora and len(handle.prefetch.calls) == 1
    finally:
        release.set()
        loop.stop()
        worker_cache.close()


def test_a_requests_text_embeddings_travel_once_and_again_only_when_its_loras_re_encode_them(lora_dir):
    store = FakeStore()
    worker_engine = _engine()
    cache = _cache(worker_engine, lora_dir)
    worker, handle = _worker(CFGWorkerCore(worker_engine, cache, ResolvedTensors(get=store.get)), store)
    engine = _engine(cfg_worker=worker)
    state = engine.start(_params(num_inference_steps=4), [loaded_lora(engine, lora_dir / f"{LORA}.safetensors")])
    puts = []
    try:
        while not state.done:
            if state.step_index == 2:
                engine.activate_loras(state)  # a text-encoder LoRA: new embeddings from here on
            engine.step([state])
            puts.append(store.puts)
    finally:
        cache.close()
    assert puts == [1, 1, 2, 2]
    references = [wire.context for (wire,) in handle.predict.calls]
    assert [[row for _, row in rows] for rows in references] == [[0]] * 4  # the unconditional row of [2, S, D]
    assert len({rows[0][0].key for rows in references}) == 2
    assert store.gets == 2  # the worker resolved each once


def test_remote_bytes_count_the_step_arrays_each_put_and_the_noise_back():
    store, sink = FakeStore(), InMemorySink()
    worker, handle = _worker(CFGWorkerCore(_engine(), None, ResolvedTensors(get=store.get)), store, Metrics(sink))
    engine = _engine(cfg_worker=worker)
    state = engine.start(_params(n=2, num_inference_steps=3))
    while not state.done:
        engine.step([state])
    wires = [wire for (wire,) in handle.predict.calls]
    puts = sum(array.nbytes for array in store.objects.values())
    assert puts == state.context.nbytes and len(wires) == 3
    assert sink.total(REMOTE_BYTES, path="cfg", direction="sent") == sum(wire.nbytes for wire in wires) + puts
    assert sink.total(REMOTE_BYTES, path="cfg", direction="received") == sum(
        answer.noise.nbytes for answer in handle.predict.answers) > 0
    assert not sink.records(REMOTE_BYTES, path="controlnet")


@pytest.mark.parametrize(("preset", "added"), [
    ("sdxl-tiny", {"text_embeds": (3, 48), "time_ids": (3, 6)}),
    ("sd3-tiny", {"pooled_projections": (3, 64)}),
    ("flux-tiny", {"pooled_projections": (3, 32), "guidance": (3,)}),
])
def test_the_rows_added_inputs_travel_to_the_worker(preset, added):
    """SDXL's pooled embedding and size ids, SD3's pooled embedding, Flux's pooled embedding and guidance (its true
    CFG's negative rows), travel with each step's rows (counted as step bytes); the images are one engine's."""
    store = FakeStore()
    components = build_preset(preset)
    worker, handle = _worker(CFGWorkerCore(DiffusionEngine("w", components, CPU), None,
                                           ResolvedTensors(get=store.get)), store)
    flux = {"true_cfg": True, "true_cfg_scale": 3.0, "negative_prompt": "green"} if preset == "flux-tiny" else {}
    requests = [(_params(seed=1, width=48, **flux), []),
                (_params(seed=2, width=48, n=2, **flux | {"negative_prompt": "blue"}), [])]
    split = denoise_together(DiffusionEngine(preset, components, CPU, cfg_worker=worker), requests)
    _assert_images_close(split, denoise_together(DiffusionEngine("alone", components, CPU), requests))
    wire = handle.predict.calls[0][0]
    assert {name: value.shape for name, value in wire.added.items()} == added
    added_bytes = sum(value.nbytes for value in wire.added.values())
    assert added_bytes == 3 * sum(math.prod(shape[1:]) for shape in added.values()) * 4  # float32 rows
    assert wire.nbytes == wire.sample.nbytes + wire.timestep.nbytes + added_bytes
    if preset == "sdxl-tiny":
        np.testing.assert_array_equal(wire.added["time_ids"][0], [64, 48, 0, 0, 64, 48])


def _denoised(engine: DiffusionEngine) -> RequestState:
    state = engine.start(_params(width=64, height=48, num_inference_steps=2))
    while not state.done:
        engine.step([state])
    return state


def _decoded_whole(engine: DiffusionEngine, state: RequestState) -> np.ndarray:
    """The images ``engine.decode`` gives without a band decode: ``vae.decode`` of all rows at once."""
    with torch.inference_mode():
        images = engine.vae.decode(state.latents / engine.vae.config.scaling_factor, return_dict=False)[0]
    return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def test_the_worker_decodes_the_lower_band_of_a_denoised_image_streamed_back():
    store, sink = FakeStore(), InMemorySink()
    metrics = Metrics(sink)
    worker, handle = _worker(CFGWorkerCore(_engine(), None, ResolvedTensors(get=store.get)), store, metrics)
    engine = _engine(metrics=metrics)
    engine.cfg_worker = worker  # attached after the engine was built, as bench_diffusion switches it
    state = _denoised(engine)
    np.testing.assert_allclose(engine.decode(state), _decoded_whole(engine, state), atol=1e-5)
    assert len(handle.decode_band.calls) == 1
    assert sink.total(BAND_DECODES, outcome="split") == 1 and not sink.records(BAND_DECODES, outcome="fallback")


def test_a_worker_failing_in_the_middle_of_a_band_leaves_the_replica_to_decode_the_whole_image():
    store, sink = FakeStore(), InMemorySink()
    core = CFGWorkerCore(_engine(), None, ResolvedTensors(get=store.get))

    async def failing(session, latents, queue):
        steps = core.band_steps(session, latents, queue, TIMEOUT_S)
        yield await anext(steps)  # the first sync; the worker dies before the second
        raise RuntimeError("worker died")

    handle = FakeHandle(predict=lambda wire: core.forward([wire])[0], decode_band=FakeStreamMethod(failing))
    metrics = Metrics(sink)
    engine = _engine(cfg_worker=ServeCFGWorker(handle, 30.0, metrics, put=store.put, band_queue=FakeQueue),
                     metrics=metrics)
    state = _denoised(engine)
    np.testing.assert_allclose(engine.decode(state), _decoded_whole(engine, state), atol=1e-5)
    assert len(handle.decode_band.calls) == 1
    assert sink.total(BAND_DECODES, outcome="fallback") == 1 and not sink.records(BAND_DECODES, outcome="split")
