"""The diffusers baseline behind the same Images API as ours: what "vanilla" means in the benchmarks that serve
both (``bench_diffusion_throughput``, ``bench_trace``). ``DiffusersBaseline`` holds the pipelines; it runs as the
Serve deployment ``VanillaDiffusers``, or in-process behind ``SerialBackend`` (``bench_trace --in-process``)."""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import AsyncIterator
from typing import Any

import torch
from PIL import Image
from ray import serve
from ray.serve import Application

from benchmarks import lora_storage
from serving.common.backpressure import queue_full
from serving.common.device import DTYPES, resolve_device
from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, ImagesAppConfig
from serving.controlnet.models import build_controlnet_preset, load_controlnet
from serving.deployments.ingress import ImagesIngress
from serving.deployments.pinning import pin_replica
from serving.engine import (
    GenerationEvent,
    GenerationParams,
    GenerationResult,
    ImageGenerationBackend,
    ModelInfo,
    encode_png,
    load_components,
)


class DiffusersBaseline:
    """diffusers pipelines over ``config``'s model and ControlNets (the same weights as ours), and its image-to-image
    and inpainting pipelines over the same modules; one request at a time per replica (a pipeline holds per-call
    state and the active LoRAs). ``adapters``: a LoRA is loaded as a PEFT adapter at its first use and kept, picked
    per request with ``set_adapters`` (nothing fused); otherwise each request's LoRAs are loaded, fused before it,
    unfused and unloaded after it. A LoRA load first fetches the file from the emulated storage, where one is
    installed (``benchmarks.lora_storage``). Answers like ``DiffusionModel``, behind the same ingress."""

    def __init__(self, config: DiffusionAppConfig, cores: list[list[int]], adapters: bool) -> None:
        import diffusers

        pin_replica(cores, "VanillaDiffusers")
        diffusers.utils.logging.set_verbosity_error()  # "no LoRA keys for the text encoder", once per load
        device, dtype = resolve_device(config.model.device), DTYPES[config.model.dtype]
        components = load_components(config.model)
        # A seeded ControlNet copies from the preset's seeded denoiser: pass ours instead of building another.
        nets = [build_controlnet_preset(net.preset, net.seed, weights=net.weights, denoiser=components.denoiser)
                if net.preset else load_controlnet(net.path) for net in config.controlnets]
        for module in [*components.modules().values(), *nets]:
            module.to(device, dtype)
        self._index = {net.name: i for i, net in enumerate(config.controlnets)}
        self._pipelines = {(): components.as_pipeline()} | {
            combo: components.as_controlnet_pipeline([nets[i] for i in combo])
            for size in range(1, len(nets) + 1) for combo in itertools.combinations(range(len(nets)), size)}
        base = self._pipelines[()]
        self._edit_pipelines = {False: diffusers.AutoPipelineForImage2Image.from_pipe(base),
                                True: diffusers.AutoPipelineForInpainting.from_pipe(base)}
        for pipe in [*self._pipelines.values(), *self._edit_pipelines.values()]:
            pipe.set_progress_bar_config(disable=True)
        self._info = ModelInfo(config.model.name, components.default_size, components.size_multiple)
        self._lora_dir = config.lora_directory()
        self._adapters = adapters
        self._loaded: set[str] = set()

    async def model_info(self) -> ModelInfo:
        return self._info

    async def list_loras(self) -> list[str]:
        return sorted(path.stem for path in self._lora_dir.glob("*.safetensors")) if self._lora_dir else []

    async def list_controlnets(self) -> list[str]:
        return sorted(self._index)

    async def generate(self, params: GenerationParams) -> GenerationResult:
        return await asyncio.to_thread(self._generate, params)

    def _load_lora(self, pipe, name: str) -> None:
        lora_storage.fetch(name)
        pipe.load_lora_weights(str(self._lora_dir), weight_name=f"{name}.safetensors", adapter_name=name,
                               local_files_only=True)

    def _pipeline_and_inputs(self, params: GenerationParams) -> tuple[object, dict]:
        """The pipeline a request runs on and its inputs beyond the prompt and sizes."""
        if params.edit is not None:
            edit = params.edit
            extra = {"image": Image.fromarray(edit.image), "strength": edit.strength}
            if edit.mask is not None:
                extra["mask_image"] = Image.fromarray(edit.mask)
            return self._edit_pipelines[edit.mask is not None], extra
        controls = sorted(params.controlnets, key=lambda spec: self._index[spec.name])
        pipe = self._pipelines[tuple(self._index[spec.name] for spec in controls)]
        if not controls:
            return pipe, {}
        images, scales = [Image.fromarray(spec.image) for spec in controls], [spec.scale for spec in controls]
        return pipe, {"image": images if len(images) > 1 else images[0],
                      "controlnet_conditioning_scale": scales if len(scales) > 1 else scales[0]}

    def _generate(self, params: GenerationParams) -> GenerationResult:
        pipe, extra = self._pipeline_and_inputs(params)
        names, scales = [spec.name for spec in params.loras], [spec.scale for spec in params.loras]
        if self._adapters:
            base = self._pipelines[()]  # adapters live in the modules every pipeline shares
            for name in names:
                if name not in self._loaded:
                    self._load_lora(base, name)
                    self._loaded.add(name)
            if names:
                base.enable_lora()
                base.set_adapters(names, scales)
            else:
                base.disable_lora()
            return self._run(pipe, params, extra)
        for name in names:
            self._load_lora(pipe, name)
        if names:
            pipe.set_adapters(names, scales)
            pipe.fuse_lora(adapter_names=names)
        try:
            return self._run(pipe, params, extra)
        finally:
            if names:
                pipe.unfuse_lora()
                pipe.unload_lora_weights()

    @staticmethod
    def _run(pipe, params: GenerationParams, extra: dict) -> GenerationResult:
        if "width" in inspect.signature(pipe.__call__).parameters:  # SD's and SDXL's img2img pipelines take none
            extra = extra | {"width": params.width, "height": params.height}
        output = pipe(prompt=params.prompt, negative_prompt=params.negative_prompt,
                      num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
                      num_images_per_prompt=params.n,
                      generator=[torch.Generator().manual_seed(params.seed + i) for i in range(params.n)],
                      output_type="np", **extra)
        return GenerationResult(images=[encode_png(image) for image in output.images], seed=params.seed)


VanillaDiffusers = serve.deployment(max_ongoing_requests=1)(DiffusersBaseline)


class SerialBackend(ImageGenerationBackend):
    """A ``DiffusersBaseline`` as the Images API's engine interface outside Serve: one request at a time, as a
    replica with ``max_ongoing_requests=1``; with ``max_queued`` set, a request finding that many already waiting
    is refused with 503 ``overloaded``, as Serve's ``max_queued_requests`` refuses it; streaming is refused."""

    def __init__(self, baseline: DiffusersBaseline, max_queued: int | None = None) -> None:
        self._baseline = baseline
        self._lock = asyncio.Lock()
        self._max_queued = max_queued
        self._waiting = 0

    async def model_info(self) -> ModelInfo:
        return await self._baseline.model_info()

    async def list_loras(self) -> list[str]:
        return await self._baseline.list_loras()

    async def list_controlnets(self) -> list[str]:
        return await self._baseline.list_controlnets()

    async def generate(self, params: GenerationParams) -> GenerationResult:
        if self._max_queued is not None and self._lock.locked() and self._waiting >= self._max_queued:
            raise queue_full()
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._baseline.generate(params)
        finally:
            self._lock.release()

    async def generate_stream(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        raise APIError(400, "the diffusers baseline does not stream", param="stream", code="invalid_value")
        yield  # an async generator, as the interface declares


def vanilla_app(configs: list[DiffusionAppConfig], cores: list[list[int]], adapters: bool,
                max_queued_requests: int = -1) -> Application:
    """Per model of ``configs``, ``VanillaDiffusers_<model>`` with one replica per entry of ``cores``, behind
    ``ImagesIngress``; ``max_queued_requests`` bounds each model's queue at the ingress (Serve's option: past it a
    request is refused with 503; -1: unbounded). Ray's CPU count only places the replicas (a hundredth of a CPU
    each); pinning decides where they run."""
    models = [VanillaDiffusers.options(name=f"VanillaDiffusers_{config.model.name}", num_replicas=len(cores),
                                       max_queued_requests=max_queued_requests,
                                       ray_actor_options={"num_cpus": 0.01}).bind(config, cores, adapters)
              for config in configs]
    return ImagesIngress.bind(models, ImagesAppConfig(models=configs))


def build_vanilla_app(args: dict[str, Any]) -> Application:
    """Serve builder (``import_path: benchmarks.vanilla:build_vanilla_app``): ``args`` holds ``models`` (the
    ``ImagesAppConfig`` entries), ``cores``, ``adapters`` and optionally ``max_queued_requests``, as
    ``vanilla_app`` takes them."""
    configs = ImagesAppConfig.model_validate({"models": args["models"]}).models
    return vanilla_app(list(configs), args["cores"], bool(args["adapters"]), int(args.get("max_queued_requests", -1)))
