"""ControlNets: conditioning images, the runner, and the engine against StableDiffusionControlNetPipeline."""

import base64
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from serving.controlnet.client import ControlNetNotFound, LocalControlNets
from serving.controlnet.conditioning import ConditioningImageError, decode_image, encode_image, preprocess
from serving.controlnet.models import build_controlnet_preset
from serving.controlnet.runner import ControlNetRunner
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.types import ControlNetSpec
from serving.engine.unet_split import SplitUNet
from serving.presets import build_preset
from tests.helpers.denoising import denoise_together, loaded_lora, pipeline_images
from tests.helpers.images import encode_b64, shape_image
from tests.helpers.lora_files import write_lora

TOLERANCE = 1e-3
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def controlnets() -> dict:
    return {"edges": build_controlnet_preset("tiny", seed=1), "mask": build_controlnet_preset("tiny", seed=2)}


@pytest.fixture(scope="module")
def engine(controlnets) -> DiffusionEngine:
    client = LocalControlNets({name: ControlNetRunner(model, CPU) for name, model in controlnets.items()})
    return DiffusionEngine("tiny", build_preset("tiny"), CPU, controlnets=client)


def _run(engine, params, loras=()):
    state = engine.start(params, list(loras))
    if loras:
        engine.activate_loras(state)
    while not state.done:
        engine.step([state])
    return engine.decode(state)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle", width=64, height=64, num_inference_steps=4, guidance_scale=7.5, seed=5)
    return GenerationParams(**{**values, **overrides})


def _reference(controlnets, params, specs, lora_path=None, lora_scale=1.0, preset: str = "tiny") -> np.ndarray:
    pipe = build_preset(preset).as_controlnet_pipeline([controlnets[spec.name] for spec in specs])
    if lora_path is not None:
        pipe.load_lora_weights(load_file(lora_path))
        pipe.fuse_lora(lora_scale=lora_scale)
    images = [Image.fromarray(spec.image) for spec in specs]
    scales = [spec.scale for spec in specs]
    return pipeline_images(pipe, params, image=images[0] if len(images) == 1 else images,
                           controlnet_conditioning_scale=scales[0] if len(scales) == 1 else scales)


def test_split_unet_equals_the_whole_forward():
    unet = build_preset("tiny").denoiser
    sample, t, context = torch.randn(3, 4, 24, 40), torch.tensor([5, 500, 900]), torch.randn(3, 77, 64)
    with torch.inference_mode():
        split = SplitUNet(unet)
        down = split.down(sample, t, context)
        residuals = [torch.randn_like(skip) for skip in down.skips]
        mid = torch.randn_like(down.sample)
        expected = unet(sample, t, context, down_block_additional_residuals=residuals,
                        mid_block_additional_residual=mid).sample
        torch.testing.assert_close(split.up(down, residuals, mid), expected)
        torch.testing.assert_close(split.up(split.down(sample, t, context)), unet(sample, t, context).sample)


@pytest.mark.parametrize("guidance", [1.0, 6.0])
def test_one_controlnet_matches_diffusers(engine, controlnets, guidance):
    specs = (ControlNetSpec("edges", shape_image("square"), 0.8),)
    params = _params(guidance_scale=guidance, n=2, controlnets=specs)
    ours = _run(engine, params)
    assert np.abs(ours - _reference(controlnets, params, specs)).max() <= TOLERANCE
    assert np.abs(ours - _run(engine, _params(guidance_scale=guidance, n=2))).max() > 20 * TOLERANCE


def test_two_controlnets_sum_like_multicontrolnet(engine, controlnets):
    specs = (ControlNetSpec("edges", shape_image("square"), 0.7), ControlNetSpec("mask", shape_image("disk"), 1.3))
    params = _params(controlnets=specs, negative_prompt="blue")
    assert np.abs(_run(engine, params) - _reference(controlnets, params, specs)).max() <= TOLERANCE


@pytest.mark.parametrize("names", [("edges",), ("edges", "mask")], ids=["one", "two"])
def test_sdxl_controlnets_match_diffusers_sdxl_controlnet_pipeline(names):
    """SDXL ControlNets take the rows' pooled embeddings and size ids too; two sum like MultiControlNetModel."""
    controlnets = {"edges": build_controlnet_preset("sdxl-tiny", seed=1), "mask": build_controlnet_preset(
        "sdxl-tiny", seed=2)}
    client = LocalControlNets({name: ControlNetRunner(model, CPU) for name, model in controlnets.items()})
    engine = DiffusionEngine("sdxl-tiny", build_preset("sdxl-tiny"), CPU, controlnets=client)
    images = {"edges": shape_image("square"), "mask": shape_image("disk")}
    specs = tuple(ControlNetSpec(name, images[name], scale) for name, scale in zip(names, (0.8, 1.2), strict=False))
    params = _params(controlnets=specs, guidance_scale=5.0, num_inference_steps=2, n=2)
    ours = _run(engine, params)
    assert np.abs(ours - _reference(controlnets, params, specs, preset="sdxl-tiny")).max() <= TOLERANCE
    plain = _run(engine, _params(guidance_scale=5.0, num_inference_steps=2, n=2))
    assert np.abs(ours - plain).max() > 20 * TOLERANCE


def test_controlnet_with_lora_matches_diffusers(engine, controlnets, tmp_path):
    path = write_lora(tmp_path / "style.safetensors", seed=3, text_encoder=True)
    specs = (ControlNetSpec("edges", shape_image("disk"), 1.0),)
    params = _params(controlnets=specs, seed=9)
    ours = _run(engine, params, [loaded_lora(engine, path, 0.7)])
    assert np.abs(ours - _reference(controlnets, params, specs, path, 0.7)).max() <= TOLERANCE


def test_batched_requests_with_different_controlnets_match_alone(engine):
    requests = [
        _params(seed=1, controlnets=(ControlNetSpec("edges", shape_image("square"), 1.0),)),
        _params(seed=2, guidance_scale=1.0),
        _params(seed=3, n=2, controlnets=(ControlNetSpec("mask", shape_image("disk"), 0.5),
                                          ControlNetSpec("edges", shape_image("disk"), 0.5))),
    ]
    alone = [_run(engine, params) for params in requests]
    states = [engine.start(params) for params in requests]
    while not all(state.done for state in states):
        engine.step(states)
    for state, expected in zip(states, alone, strict=True):
        assert np.abs(engine.decode(state) - expected).max() <= TOLERANCE


def test_unknown_controlnet_is_refused_before_work(engine):
    with pytest.raises(ControlNetNotFound):
        engine.start(_params(controlnets=(ControlNetSpec("depth", shape_image("disk")),)))


def test_decode_accepts_png_jpeg_and_data_urls():
    image = shape_image("square")
    assert np.array_equal(decode_image(encode_b64(image), max_bytes=2**20, max_pixels=2**20), image)
    jpeg = decode_image("data:image/jpeg;base64," + encode_b64(image, "JPEG"), max_bytes=2**20, max_pixels=2**20)
    assert jpeg.shape == (64, 64, 3) and np.abs(jpeg.astype(int) - image).mean() < 10


def test_encode_image_is_what_decode_image_reads_back_exactly():
    image = shape_image("disk")
    encoded = encode_image(image)
    assert base64.b64decode(encoded)[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.array_equal(decode_image(encoded, max_bytes=2**20, max_pixels=2**20), image)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not base64!!", "base64"),
        (base64.b64encode(b"GIF89a garbage").decode(), "format"),
        (base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(), "IHDR"),
        (base64.b64encode(b"\xff\xd8\xff\xe0\0\x10JFIF").decode(), "truncated"),
        (encode_b64(np.zeros((8, 8, 3), np.uint8), "BMP"), "format"),
        (encode_b64(np.zeros((100, 100, 3), np.uint8)), "pixels"),
        ("A" * 10_000, "larger"),
    ],
)
def test_decode_refuses_bad_images(data, message):
    with pytest.raises(ConditioningImageError, match=message):
        decode_image(data, max_bytes=4096, max_pixels=64 * 64)


def test_canny_marks_the_shape_outline():
    edges = preprocess(shape_image("square"), "canny")
    assert edges.shape == (64, 64, 3) and set(np.unique(edges)) == {0, 255}
    assert edges[16:48, 11:13].max() == 255 and edges[30, 25].max() == 0  # on the border, not inside


def test_parallel_cfg_gives_the_same_images(engine, controlnets, tmp_path):
    from serving.engine.cfg import LocalCFGWorker

    client = LocalControlNets({name: ControlNetRunner(model, CPU) for name, model in controlnets.items()})
    worker = LocalCFGWorker(DiffusionEngine("tiny", build_preset("tiny"), CPU, controlnets=client))
    parallel = DiffusionEngine("tiny", build_preset("tiny"), CPU, controlnets=client, cfg_worker=worker)
    path = write_lora(tmp_path / "style.safetensors", seed=4)
    requests = [
        (_params(seed=1, n=2, controlnets=(ControlNetSpec("edges", shape_image("square"), 0.9),)), "style"),
        (_params(seed=2, guidance_scale=1.0), None),
        (_params(seed=3, negative_prompt="green"), None),
    ]

    def run_all(target: DiffusionEngine) -> list[np.ndarray]:
        return denoise_together(target, [(params, [loaded_lora(target, path)] if lora else [])
                                         for params, lora in requests])

    try:
        for together, alone in zip(run_all(parallel), run_all(engine), strict=True):
            assert np.abs(together - alone).max() <= TOLERANCE
    finally:
        worker.close()


def test_failing_controlnet_fails_only_its_requests(controlnets):
    from serving.config import EngineConfig
    from serving.controlnet.client import ControlNetUnavailable
    from serving.engine import EngineLoop

    class Dying(ControlNetRunner):
        def run(self, call):
            raise RuntimeError("replica died")

    client = LocalControlNets({"edges": ControlNetRunner(controlnets["edges"], CPU),
                               "mask": Dying(controlnets["mask"], CPU)})
    engine = DiffusionEngine("tiny", build_preset("tiny"), CPU, controlnets=client)
    loop = EngineLoop(engine, EngineConfig())
    try:
        doomed = loop.submit(_params(controlnets=(ControlNetSpec("mask", shape_image("disk")),)))
        fine = [loop.submit(_params(seed=2, controlnets=(ControlNetSpec("edges", shape_image("disk")),))),
                loop.submit(_params(seed=3))]
        with pytest.raises(ControlNetUnavailable, match="mask"):
            doomed.result(timeout=60)
        assert all(len(future.result(timeout=60).images) == 1 for future in fine)
        assert len(loop.submit(_params(seed=4)).result(timeout=60).images) == 1  # the loop keeps serving
    finally:
        loop.stop()


def test_a_failing_cfg_worker_leaves_its_rows_to_the_engine():
    """A guided and an unguided request in one batch: both finish, the guided rows computed by the engine itself,
    each step counted as a fallback."""
    from serving.common.metrics import CFG_LOCAL_FALLBACKS, InMemorySink, Metrics
    from serving.engine.cfg import LocalCFGWorker

    class Broken(LocalCFGWorker):
        def submit(self, batch):
            failed: Future = Future()
            failed.set_exception(RuntimeError("worker died"))
            return failed

    sink = InMemorySink()
    worker = Broken(DiffusionEngine("tiny", build_preset("tiny"), CPU))
    engine = DiffusionEngine("tiny", build_preset("tiny"), CPU, cfg_worker=worker, metrics=Metrics(sink))
    requests = [_params(guidance_scale=5.0, seed=1), _params(guidance_scale=1.0, seed=2)]
    try:
        images = denoise_together(engine, [(params, []) for params in requests])
    finally:
        worker.close()
    expected = denoise_together(DiffusionEngine("tiny", build_preset("tiny"), CPU),
                                [(params, []) for params in requests])
    for ours, reference in zip(images, expected, strict=True):
        assert np.abs(ours - reference).max() <= TOLERANCE
    assert sink.total(CFG_LOCAL_FALLBACKS) == requests[0].num_inference_steps


def test_a_slow_controlnet_call_runs_while_the_down_and_mid_blocks_do(controlnets):
    """The call answers only once the UNet's mid block has run (it waits for that), so the UNet's first half never
    waited for it; timestamps order the rest, and the residuals are used (the image differs from the uncontrolled)."""
    events: dict[str, float] = {}
    call_ended = []
    mid_ran = threading.Event()

    class HeldUntilTheMidBlock(ControlNetRunner):
        def run(self, call):
            events.setdefault("call_started", time.perf_counter())
            assert mid_ran.wait(60), "the down and mid blocks did not run while the ControlNet call did"
            residuals = super().run(call)
            call_ended.append(time.perf_counter())
            return residuals

    engine = DiffusionEngine("tiny", build_preset("tiny"), CPU, controlnets=LocalControlNets(
        {"edges": HeldUntilTheMidBlock(controlnets["edges"], CPU)}))
    def stamp(name):
        def hook(*_):
            events.setdefault(name, time.perf_counter())  # returns None: the hook leaves the forward alone
            if name == "mid_ended":
                mid_ran.set()
        return hook

    unet = engine.denoiser.module
    hooks = [unet.down_blocks[0].register_forward_pre_hook(stamp("down_started")),
             unet.mid_block.register_forward_hook(stamp("mid_ended")),
             unet.up_blocks[0].register_forward_pre_hook(stamp("up_started"))]
    try:
        params = _params(num_inference_steps=1, controlnets=(ControlNetSpec("edges", shape_image("square")),))
        controlled = _run(engine, params)
    finally:
        for hook in hooks:
            hook.remove()
    assert events["call_started"] < events["down_started"] < events["mid_ended"] < call_ended[0]
    assert call_ended[0] <= events["up_started"]  # the up blocks waited for the residuals
    assert np.abs(controlled - _run(engine, _params(num_inference_steps=1))).max() > TOLERANCE


def test_the_loops_busy_time_leaves_out_the_steps_waits_for_a_slow_controlnet(controlnets):
    """``busy_s`` (what benchmarks call the engine's busy fraction) is every step's time but the time ``step`` sat
    blocked on ControlNet residuals; the step-latency metric keeps the whole step."""
    from serving.common.metrics import STEP_LATENCY, InMemorySink, Metrics
    from serving.config import EngineConfig
    from serving.engine import EngineLoop

    mid_ran = threading.Event()

    class Slow(ControlNetRunner):
        """Answers 0.3 s after the step's mid block ran: the step then waits at least that long for it."""

        def run(self, call):
            assert mid_ran.wait(60), "the mid block did not run while the ControlNet call did"
            mid_ran.clear()
            time.sleep(0.3)
            return super().run(call)

    sink = InMemorySink()
    engine = DiffusionEngine("tiny", build_preset("tiny"), CPU, metrics=Metrics(sink),
                             controlnets=LocalControlNets({"edges": Slow(controlnets["edges"], CPU)}))
    engine.denoiser.module.mid_block.register_forward_hook(lambda *_: mid_ran.set())
    loop = EngineLoop(engine, EngineConfig(), metrics=Metrics(sink))
    try:
        params = _params(num_inference_steps=2, controlnets=(ControlNetSpec("edges", shape_image("square")),))
        loop.submit(params).result(timeout=60)
    finally:
        loop.stop()
    steps_s = sum(sink.values(STEP_LATENCY)) / 1e3
    assert engine.remote_wait_s >= 2 * 0.3 - 0.1  # each step waited out its call's sleep, but for a few statements
    assert loop.busy_s == pytest.approx(steps_s - engine.remote_wait_s, abs=1e-6)
