"""The diffusion engine: an explicit denoising step loop on diffusers components.

Numerically it follows the family's diffusers pipeline (``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``,
``StableDiffusion3Pipeline``: same tokenisation, noise, scheduler calls, CFG and decoding), but the state lives in
``RequestState`` objects, so one denoiser forward can serve rows from many requests, each at its own timestep, with
its own LoRAs, guidance and scheduler.
"""

from __future__ import annotations

import inspect
import io
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from PIL import Image

from serving.common.device import DTYPES, placement, resolve_device, set_torch_threads
from serving.common.errors import APIError
from serving.common.logging import get_logger
from serving.common.metrics import NO_METRICS, Metrics
from serving.config import DiffusionModelConfig, LoRAConfig
from serving.controlnet.client import ControlNetClient, ControlNetNotFound, ControlNetUnavailable
from serving.controlnet.conditioning import to_controlnet_input
from serving.controlnet.runner import ControlNetCall, ControlNetResiduals
from serving.engine.band_decode import BandDecodeUnsupported, check_band_decodable, decode_with_peer
from serving.engine.cfg import CFGWorker
from serving.engine.denoisers import denoiser_for
from serving.engine.prompts import prompt_encoder
from serving.engine.request import LoRAActivation, PendingLoRA, RequestState
from serving.engine.rows import RowBatch
from serving.engine.types import GenerationParams, ModelInfo
from serving.lora.apply import LoRAHooks, plan_lora_rows
from serving.lora.format import LoRATargets
from serving.lora.weights import LoRAWeights
from serving.presets import DiffusionComponents, build_preset, load_local

logger = get_logger("engine")

_DEVICE_LORA_COPIES = 16


class InvalidImageSize(APIError, ValueError):
    """An image side that is not a multiple of the model's ``size_multiple``, or over its ``max_side``: 400."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, code="invalid_value")


def load_components(config: DiffusionModelConfig) -> DiffusionComponents:
    """Build a preset or load a local directory, as ``config`` says."""
    if config.preset is not None:
        return build_preset(config.preset, seed=config.seed, weights=config.weights)
    assert config.path is not None
    return load_local(config.path)


def encode_png(image: np.ndarray) -> bytes:
    """An HxWx3 float image in [0, 1] as PNG bytes (rounded like diffusers' ``numpy_to_pil``)."""
    buffer = io.BytesIO()
    Image.fromarray((image * 255).round().astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


class DiffusionEngine:
    """Denoising primitives on one model and device. Called from a single thread (the engine loop)."""

    def __init__(self, name: str, components: DiffusionComponents, device: torch.device,
                 dtype: torch.dtype = torch.float32, *, merged_lora_bytes: int = 2**30,
                 lora_merge_after: int = 8, controlnets: ControlNetClient | None = None,
                 cfg_worker: CFGWorker | None = None, metrics: Metrics = NO_METRICS) -> None:
        self.info = ModelInfo(name=name, default_size=components.default_size,
                              size_multiple=components.size_multiple, family=components.family)
        self.max_side = components.max_side
        self.device, self.dtype = device, dtype
        # SDXL's VAE overflows in float16 (``force_upcast``): it decodes in float32, as diffusers' SDXL pipeline.
        upcast = components.family == "sdxl" and dtype == torch.float16 and components.vae.config.force_upcast
        self.vae_dtype = torch.float32 if upcast else dtype
        for name, module in components.modules().items():
            module.to(device)
            module_dtype = self.vae_dtype if name == "vae" else dtype
            if module_dtype != torch.float32:
                module.to(module_dtype)
        self.denoiser = denoiser_for(components.denoiser, controlled=controlnets is not None)
        self.vae, self.text_encoder = components.vae, components.text_encoder
        self.base_scheduler = components.scheduler
        self.vae_scale_factor = components.vae_scale_factor
        # SD3 decodes ``latents / scaling + shift`` and its ControlNets take ``(image latents - shift) * scaling``
        self._vae_shift = self.vae.config.get("shift_factor") or 0.0
        self.lora_targets = LoRATargets.from_modules(components.denoiser, self.text_encoder, components.text_encoder_2)
        # The denoiser runs every step: a merged copy can pay off. A text encoder runs once per request: never merge.
        self._denoiser_loras = LoRAHooks(self.denoiser.module, merged_cache_bytes=merged_lora_bytes,
                                         merge_after=lora_merge_after)
        self.prompts = prompt_encoder(components, device, dtype)
        self._device_loras: OrderedDict[int, tuple[LoRAWeights, LoRAWeights]] = OrderedDict()
        self.controlnets = controlnets
        self.cfg_worker = cfg_worker
        self.metrics = metrics
        self._band_decodable = _band_decodable(self.vae)  # with a CFG worker, set now or later
        step_parameters = set(inspect.signature(self.base_scheduler.step).parameters)
        self._step_takes_eta = "eta" in step_parameters
        self._step_takes_generator = "generator" in step_parameters

    @classmethod
    def from_config(cls, config: DiffusionModelConfig, lora: LoRAConfig | None = None,
                    controlnets: ControlNetClient | None = None, cfg_worker: CFGWorker | None = None,
                    metrics: Metrics = NO_METRICS) -> DiffusionEngine:
        device = resolve_device(config.device)
        set_torch_threads(config.torch_threads)
        lora = lora or LoRAConfig()
        started = time.perf_counter()
        engine = cls(config.name, load_components(config), device, DTYPES[config.dtype],
                     merged_lora_bytes=lora.merged_cache_bytes, lora_merge_after=lora.merge_after_forwards,
                     controlnets=controlnets, cfg_worker=cfg_worker, metrics=metrics)
        source = f"preset={config.preset}" if config.preset else f"path={config.path}"
        logger.info("diffusion model %r loaded (%s, device=%s, dtype=%s) in %.1fs on %s",
                    config.name, source, device, config.dtype, time.perf_counter() - started, placement())
        return engine

    # -- request lifecycle -------------------------------------------------------------------------

    def validate(self, params: GenerationParams) -> None:
        """Refuses what this model cannot serve: ``InvalidImageSize``, ``ControlNetNotFound``."""
        multiple = self.info.size_multiple
        if params.width % multiple or params.height % multiple:
            raise InvalidImageSize(f"width and height must be multiples of {multiple}")
        if self.max_side is not None and max(params.width, params.height) > self.max_side:
            raise InvalidImageSize(f"width and height must be at most {self.max_side} for this model")
        served = set(self.controlnets.names()) if self.controlnets is not None else set()
        for spec in params.controlnets:
            if spec.name not in served:
                raise ControlNetNotFound(spec.name)

    @torch.inference_mode()
    def start(self, params: GenerationParams, loras: Sequence[PendingLoRA] = (),
              lora_wait_fraction: float = 0.4) -> RequestState:
        """Tokenise and encode the prompts, draw the initial noise, set up the request's own scheduler. The request
        waits for LoRAs still loading at step ``lora_wait_fraction * steps`` (``async``) or 0 (``exact``)."""
        self.validate(params)
        scheduler = type(self.base_scheduler).from_config(self.base_scheduler.config)
        scheduler.set_timesteps(params.num_inference_steps, device=self.device, **self._timestep_kwargs(params))
        generators = [torch.Generator("cpu").manual_seed(params.seed + i) for i in range(params.n)]
        prompt_embeds, negative_embeds = self.prompts.encode(params)
        shape = (1, self.denoiser.in_channels, params.height // self.vae_scale_factor,
                 params.width // self.vae_scale_factor)
        noise = [torch.randn(shape, generator=g, dtype=self.dtype) for g in generators]
        # flow-matching schedulers start from unit noise and have no ``init_noise_sigma``
        latents = torch.cat(noise).to(self.device) * getattr(scheduler, "init_noise_sigma", 1.0)
        return RequestState(
            params=params,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            latents=latents,
            generators=generators,
            prompt_embeds=prompt_embeds,
            negative_embeds=negative_embeds,
            controls=[(spec.name, self._control_input(spec.image, params), spec.scale) for spec in params.controlnets],
            loras=list(loras),
            lora_step=_lora_deadline(params, lora_wait_fraction),
        )

    @torch.inference_mode()
    def prepare_loras(self, state: RequestState) -> LoRAActivation:
        """The request's (loaded) LoRAs on this device, and its text re-encoded where they touch the encoder. Reads
        ``state`` only: it may run on another thread while the request keeps denoising."""
        loras = [(self.lora_on_device(pending.load.result()), pending.scale) for pending in state.loras]
        touching = [(weights, scale) for weights, scale in loras if weights.targets_text]
        embeds = self.prompts.encode(state.params, touching) if touching else None
        return LoRAActivation(loras, embeds)

    def apply_loras(self, state: RequestState, activation: LoRAActivation) -> None:
        """Applies a ``prepare_loras`` result from the request's next step on (on the thread that runs steps)."""
        for weights, _ in activation.loras:
            self._denoiser_loras.ensure_hooks(weights.denoiser)
        state.active_loras = activation.loras
        if activation.embeds is not None:
            state.prompt_embeds, state.negative_embeds = activation.embeds
        state.lora_applied_at = state.step_index

    def activate_loras(self, state: RequestState) -> None:
        """``prepare_loras`` and ``apply_loras`` at once, on the calling thread."""
        self.apply_loras(state, self.prepare_loras(state))

    @torch.inference_mode()
    def step(self, states: Sequence[RequestState]) -> None:
        """One denoising step for every request in ``states``: all rows in one denoiser forward, or with a CFG
        worker, the unconditional rows there and the rest here, at the same time. When the worker fails, this
        engine computes its rows too (logged and counted): the step is slower, no request fails for it. So it does
        the rows the worker skipped (their LoRAs still loading there; counted)."""
        batch = RowBatch.for_states(states)
        if self.cfg_worker is None or not any(state.params.uses_cfg for state in states):
            noise = self.predict_noise(batch)
        else:
            remote, local, offset = [], [], 0
            for state in states:
                half = state.params.n if state.params.uses_cfg else 0
                remote += range(offset, offset + half)
                local += range(offset + half, offset + state.rows)
                offset += state.rows
            pending = self.cfg_worker.submit(batch.select(remote))
            local_noise = self.predict_noise(batch.select(local))
            noise = local_noise.new_empty((batch.rows, *local_noise.shape[1:]))
            noise[local] = local_noise
            try:
                answer = pending.result()
            except Exception as exc:
                logger.warning("CFG worker failed (%s: %s); computing its %d rows here", type(exc).__name__, exc,
                               len(remote))
                self.metrics.cfg_local_fallback()
                left = remote
            else:
                skipped = set(answer.skipped)
                done = [row for index, row in enumerate(remote) if index not in skipped]
                if done:
                    noise[done] = answer.noise.to(noise.device, noise.dtype)
                left = [remote[index] for index in answer.skipped]
                if left:
                    self.metrics.cfg_lora_local_rows(len(left))
            if left:
                noise[left] = self.predict_noise(batch.select(left))
        offset = 0
        for state in states:
            prediction = noise[offset:offset + state.rows]
            offset += state.rows
            if state.params.uses_cfg:
                uncond, cond = prediction.chunk(2)
                prediction = uncond + state.params.guidance_scale * (cond - uncond)
            state.latents = state.scheduler.step(
                prediction, state.timesteps[state.step_index], state.latents,
                **self._step_kwargs(state), return_dict=False,
            )[0]
            state.step_index += 1

    @torch.inference_mode()
    def predict_noise(self, batch: RowBatch) -> torch.Tensor:
        """The denoiser's prediction for every row, with each row's LoRAs and ControlNets."""
        assignments = [[(weights.denoiser, scale) for weights, scale in row] for row in batch.loras]
        for layers in {id(layers): layers for row in assignments for layers, _ in row}.values():
            self._denoiser_loras.ensure_hooks(layers)  # rows may come from another engine (parallel CFG)
        with self._denoiser_loras.active(plan_lora_rows(assignments, self.device)):
            if any(batch.controls):
                return self.denoiser.predict_controlled(batch.sample, batch.timestep, batch.context, batch.added,
                                                        self._submit_controlnets(batch))
            return self.denoiser.predict(batch.sample, batch.timestep, batch.context, batch.added)

    @torch.inference_mode()
    def decode(self, state: RequestState) -> np.ndarray:
        """The request's images as float32 [n, H, W, 3] in [0, 1]. With a CFG worker, its device decodes the lower
        half of the rows meanwhile (``band_decode``); if it fails, this engine decodes the whole (logged, counted)."""
        latents = state.latents.to(self.vae_dtype) / self.vae.config.scaling_factor + self._vae_shift
        images = None
        if self.cfg_worker is not None and self._band_decodable and latents.shape[2] >= 2:
            try:
                images = decode_with_peer(self.vae, latents, self.cfg_worker.band_peer(latents))
            except Exception as exc:
                logger.warning("band decode with the CFG worker failed (%s: %s); decoding here", type(exc).__name__,
                               exc)
                self.metrics.band_decode("fallback")
            else:
                self.metrics.band_decode("split")
        if images is None:
            images = self.vae.decode(latents, return_dict=False)[0]
        return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()

    # -- helpers -----------------------------------------------------------------------------------

    def _submit_controlnets(self, batch: RowBatch) -> Callable[[], ControlNetResiduals]:
        """Starts this step's ControlNet calls, one per ControlNet, each with the rows that use it; returns what
        waits for their residuals, summed over ControlNets (as ``MultiControlNetModel`` does; zeros for a row no
        ControlNet conditions)."""
        assert self.controlnets is not None
        rows_by_net: dict[str, list[tuple[int, torch.Tensor, float]]] = {}
        for row, controls in enumerate(batch.controls):
            for name, image, scale in controls:
                rows_by_net.setdefault(name, []).append((row, image, scale))
        pending = []
        for name, entries in rows_by_net.items():
            index = torch.tensor([row for row, _, _ in entries], dtype=torch.long, device=self.device)
            images: list[tuple[torch.Tensor, int]] = []  # consecutive rows of one image sent once
            for _, image, _ in entries:
                if images and images[-1][0] is image:
                    images[-1] = (image, images[-1][1] + 1)
                else:
                    images.append((image, 1))
            call = ControlNetCall(sample=batch.sample[index], timestep=batch.timestep[index.to(batch.timestep.device)],
                                  encoder_hidden_states=batch.context[index],
                                  context_rows=[batch.context_rows[row] for row, _, _ in entries],
                                  scales=torch.tensor([scale for _, _, scale in entries]), images=images,
                                  added={key: value[index] for key, value in batch.added.items()},
                                  latent_shift=self._vae_shift * self.vae.config.scaling_factor)
            pending.append((name, index, self.controlnets.submit(name, call)))

        def summed() -> ControlNetResiduals:
            down: list[torch.Tensor] = []
            mid: torch.Tensor | None = None
            for name, index, future in pending:
                try:
                    residuals = future.result()
                except Exception as exc:
                    raise ControlNetUnavailable(name, exc) from exc
                if not down:
                    down = [_zero_rows(batch.rows, part, batch.sample) for part in residuals.down]
                    mid = _zero_rows(batch.rows, residuals.mid, batch.sample) if residuals.mid is not None else None
                for total, part in zip(down, residuals.down, strict=True):
                    total.index_add_(0, index, part.to(total.device, total.dtype))
                if mid is not None and residuals.mid is not None:
                    mid.index_add_(0, index, residuals.mid.to(mid.device, mid.dtype))
            return ControlNetResiduals(down, mid)

        return summed

    def _control_input(self, image: np.ndarray, params: GenerationParams) -> torch.Tensor:
        """A conditioning image as the family's ControlNets take it: the image in [0, 1] [1, 3, H, W] (SD, SDXL);
        SD3: its VAE latents ``(mode - shift) * scaling`` [1, C, h, w] (diffusers samples the latent distribution;
        the engine takes its mode, so one image conditions every row and request alike)."""
        pixels = to_controlnet_input(image, params.width, params.height).to(self.device)
        if self.info.family != "sd3":
            return pixels
        latents = self.vae.encode((pixels * 2 - 1).to(self.vae_dtype)).latent_dist.mode()
        return ((latents - self._vae_shift) * self.vae.config.scaling_factor).to(self.dtype)

    def lora_on_device(self, weights: LoRAWeights) -> LoRAWeights:
        """One device copy per cached LoRA, shared by the requests using it (same objects: same batch group).
        Called from one thread only (an engine's stage thread, or a CFG worker's)."""
        entry = self._device_loras.get(id(weights))
        if entry is None or entry[0] is not weights:
            entry = (weights, weights.to(self.device, self.dtype))
            self._device_loras[id(weights)] = entry
            while len(self._device_loras) > _DEVICE_LORA_COPIES:
                self._device_loras.popitem(last=False)
        self._device_loras.move_to_end(id(weights))
        return entry[1]

    def _timestep_kwargs(self, params: GenerationParams) -> dict:
        """SD3.5-style dynamic shifting: the schedule's shift ``mu`` from the image's token count, as diffusers'
        SD3 pipeline computes it."""
        config = self.base_scheduler.config
        if not config.get("use_dynamic_shifting"):
            return {}
        patch = getattr(self.denoiser.module.config, "patch_size", 1)
        tokens = (params.height // self.vae_scale_factor // patch) * (params.width // self.vae_scale_factor // patch)
        return {"mu": calculate_shift(tokens, config.get("base_image_seq_len", 256),
                                      config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                      config.get("max_shift", 1.16))}

    def _step_kwargs(self, state: RequestState) -> dict:
        kwargs: dict = {}
        if self._step_takes_eta:
            kwargs["eta"] = 0.0
        if self._step_takes_generator:
            kwargs["generator"] = state.generators
        return kwargs


def _band_decodable(vae: torch.nn.Module) -> bool:
    try:
        check_band_decodable(vae)
    except BandDecodeUnsupported as exc:
        logger.info("this VAE decodes whole, also with a CFG worker: %s", exc)
        return False
    return True


def _zero_rows(rows: int, part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Zeros for ``rows`` rows shaped as ``part``'s, on ``like``'s device and dtype."""
    return torch.zeros((rows, *part.shape[1:]), device=like.device, dtype=like.dtype)


def _lora_deadline(params: GenerationParams, lora_wait_fraction: float) -> int:
    """The step at which a request stops for LoRAs that are still loading."""
    if params.lora_mode == "exact":
        return 0
    return math.floor(lora_wait_fraction * params.num_inference_steps + 1e-9)
