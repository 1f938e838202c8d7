"""The diffusion engine: an explicit denoising step loop on diffusers components.

Numerically it follows the family's diffusers pipeline (``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``,
``StableDiffusion3Pipeline``: same tokenisation, noise, scheduler calls, CFG and decoding), but the state lives in
``RequestState`` objects, so one denoiser forward can serve rows from many requests, each at its own timestep, with
its own LoRAs, guidance and scheduler.
"""

from __future__ import annotations

import io
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, TypeVar

import numpy as np
import torch
from diffusers import SchedulerMixin
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from PIL import Image

from serving.common.device import DTYPES, free_memory_bytes, placement, resolve_device, set_torch_threads
from serving.common.errors import APIError
from serving.common.logging import get_logger
from serving.common.metrics import NO_METRICS, Metrics
from serving.config import DiffusionModelConfig, LoRAConfig
from serving.controlnet.client import ControlNetClient, ControlNetNotFound, ControlNetUnavailable
from serving.controlnet.conditioning import to_controlnet_input
from serving.controlnet.runner import ControlNetCall, ControlNetResiduals
from serving.engine.band_decode import BandDecodeUnsupported, check_band_decodable, decode_with_peer
from serving.engine.cfg import CFGWorker, WorkerPatience
from serving.engine.denoisers import denoiser_for
from serving.engine.prompts import prompt_encoder
from serving.engine.request import Inpainting, LoRAActivation, PendingLoRA, RequestState
from serving.engine.rows import RowBatch
from serving.engine.schedulers import SchedulerChoices, edit_start, edit_timesteps, noised, step_kwargs
from serving.engine.types import EditImage, GenerationParams, ModelInfo
from serving.engine.vae import encode_mode, to_denoiser_latents, to_images, to_vae_latents, vae_shift
from serving.lora.apply import LoRAHooks, plan_lora_rows
from serving.lora.format import LoRATargets
from serving.lora.weights import LoRAWeights
from serving.presets import DiffusionComponents, build_preset, load_local
from serving.single_file import load_single_file

T = TypeVar("T")
logger = get_logger("engine")

_DEVICE_LORA_COPIES = 16
#: ``lora.merged_cache_bytes: auto`` keeps merged copies within this share of the device memory free once the
#: model is loaded
AUTO_MERGED_FREE_SHARE = 0.5


class InvalidImageSize(APIError, ValueError):
    """An image side that is not a multiple of the model's ``size_multiple``, or over its ``max_side``: 400."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, code="invalid_value")


def load_components(config: DiffusionModelConfig) -> DiffusionComponents:
    """Build a preset, load a local directory or a single-file checkpoint, as ``config`` says."""
    if config.preset is not None:
        return build_preset(config.preset, seed=config.seed, weights=config.weights)
    if config.single_file is not None:
        assert config.config is not None
        return load_single_file(config.single_file, config.config)
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
                 dtype: torch.dtype = torch.float32, *, merged_lora_bytes: int | Literal["auto"] = "auto",
                 lora_merge_after: int = 8, controlnets: ControlNetClient | None = None,
                 cfg_worker: CFGWorker | None = None, cfg_patience: WorkerPatience | None = None,
                 metrics: Metrics = NO_METRICS) -> None:
        self.schedulers = SchedulerChoices(components.scheduler, custom_sigmas=components.family == "flux")
        self.latent_factor = components.latent_factor
        self.info = ModelInfo(name=name, default_size=components.default_size,
                              size_multiple=components.size_multiple, family=components.family,
                              schedulers=self.schedulers.names, default_scheduler=self.schedulers.default,
                              true_cfg=components.family == "flux")
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
        self.vae_scale_factor = components.vae_scale_factor
        self.lora_targets = LoRATargets.from_modules(components.denoiser, self.text_encoder, components.text_encoder_2)
        # The denoiser runs every step: a merged copy can pay off. A text encoder runs once per request: never merge.
        # ``auto``: merged copies of whatever the LoRAs in use target, within a share of the memory left now
        self._denoiser_loras = LoRAHooks(
            self.denoiser.module, merged_cache_bytes=merged_lora_bytes, merge_after=lora_merge_after,
            max_merged_bytes=int(AUTO_MERGED_FREE_SHARE * free_memory_bytes(device))
            if merged_lora_bytes == "auto" else None)
        self.prompts = prompt_encoder(components, device, dtype)
        self._device_loras: OrderedDict[int, tuple[LoRAWeights, LoRAWeights]] = OrderedDict()
        self.controlnets = controlnets
        self.cfg_worker = cfg_worker
        self.cfg_patience = cfg_patience or WorkerPatience()
        self.metrics = metrics
        #: Seconds ``step`` has spent blocked on remote results (ControlNet residuals, the CFG worker's rows).
        self.remote_wait_s = 0.0
        self._band_decodable = _band_decodable(self.vae)  # with a CFG worker, set now or later
        #: an inpainting checkpoint: its denoiser takes the mask and the masked image's latents beside the latents
        self.inpainting_denoiser = self.denoiser.in_channels == 2 * self.vae.config.latent_channels + 1

    @classmethod
    def from_config(cls, config: DiffusionModelConfig, lora: LoRAConfig | None = None,
                    controlnets: ControlNetClient | None = None, cfg_worker: CFGWorker | None = None,
                    cfg_patience: WorkerPatience | None = None, metrics: Metrics = NO_METRICS) -> DiffusionEngine:
        device = resolve_device(config.device)
        set_torch_threads(config.torch_threads)
        lora = lora or LoRAConfig()
        started = time.perf_counter()
        engine = cls(config.name, load_components(config), device, DTYPES[config.dtype],
                     merged_lora_bytes=lora.merged_cache_bytes, lora_merge_after=lora.merge_after_forwards,
                     controlnets=controlnets, cfg_worker=cfg_worker, cfg_patience=cfg_patience, metrics=metrics)
        logger.info("diffusion model %r loaded (%s, device=%s, dtype=%s) in %.1fs on %s",
                    config.name, config.source(), device, config.dtype, time.perf_counter() - started, placement())
        return engine

    @property
    def base_scheduler(self) -> SchedulerMixin:
        """The model's own scheduler, which every request's is made from."""
        return self.schedulers.base

    # -- request lifecycle -------------------------------------------------------------------------

    def validate(self, params: GenerationParams) -> None:
        """Refuses what this model cannot serve: ``InvalidImageSize``, ``ControlNetNotFound``, an unknown scheduler,
        an edit it cannot make, anything but inpainting on an inpainting checkpoint (400s naming the field)."""
        multiple = self.info.size_multiple
        if params.width % multiple or params.height % multiple:
            raise InvalidImageSize(f"width and height must be multiples of {multiple}")
        if self.max_side is not None and max(params.width, params.height) > self.max_side:
            raise InvalidImageSize(f"width and height must be at most {self.max_side} for this model")
        if self.inpainting_denoiser:
            _validate_for_inpainting_denoiser(params)
        served = set(self.controlnets.names()) if self.controlnets is not None else set()
        for spec in params.controlnets:
            if spec.name not in served:
                raise ControlNetNotFound(spec.name)
        if params.scheduler is not None and params.scheduler not in self.schedulers.names:
            raise _invalid("scheduler", f"unknown scheduler {params.scheduler!r}; this model offers: "
                                        f"{', '.join(self.schedulers.names)}")
        if params.edit is not None:
            self._validate_edit(params, params.edit)

    def _validate_edit(self, params: GenerationParams, edit: EditImage) -> None:
        """Refuses an edit whose image or mask is not at the request's size, whose strength leaves no step (as
        diffusers' pipelines do), or whose scheduler diffusers' edit pipelines of this family cannot run."""
        size = (params.height, params.width)
        if edit.image.shape != (*size, 3):
            raise _invalid("image", f"the image must be {params.width}x{params.height} RGB, as the request")
        if edit.mask is not None and edit.mask.shape != size:
            raise _invalid("mask", f"the mask must be {params.width}x{params.height}, as the image")
        if not 0.0 < edit.strength <= 1.0:
            raise _invalid("strength", "strength must be in (0, 1]")
        steps = params.num_inference_steps
        if edit_start(steps, edit.strength, flow=self.schedulers.flow) >= steps:
            raise _invalid("strength", f"strength {edit.strength} leaves no denoising step of {steps}; raise "
                                       "strength or the number of steps")
        if not self.schedulers.can_edit(params.scheduler):
            editing = [name for name in self.schedulers.names if self.schedulers.can_edit(name)]
            raise _invalid("scheduler", f"scheduler {params.scheduler!r} cannot edit images on this model; use one "
                                        f"of: {', '.join(editing)}")

    @torch.inference_mode()
    def start(self, params: GenerationParams, loras: Sequence[PendingLoRA] = (),
              lora_wait_fraction: float = 0.4) -> RequestState:
        """Tokenise and encode the prompts, set up the request's own scheduler (an edit's cut by its strength), draw
        its initial latents. The request waits for LoRAs still loading at ``lora_wait_fraction`` of its steps
        (``async``) or at once (``exact``)."""
        self.validate(params)
        scheduler, timesteps = self._schedule(params, self.device)
        generators = [torch.Generator("cpu").manual_seed(params.seed + i) for i in range(params.n)]
        prompt_embeds, negative_embeds = self.prompts.encode(params)
        if params.edit is None:
            # flow-matching schedulers start from unit noise and have no ``init_noise_sigma``
            initial = _Start(self._noise(params, generators) * getattr(scheduler, "init_noise_sigma", 1.0))
        elif params.edit.mask is None:
            initial = _Start(self._image_to_image(params, params.edit, scheduler, timesteps, generators))
        else:
            initial = self._inpaint(params, params.edit, scheduler, timesteps, generators)
        return RequestState(
            params=params,
            scheduler=scheduler,
            timesteps=timesteps,
            latents=initial.latents,
            generators=generators,
            prompt_embeds=prompt_embeds,
            negative_embeds=negative_embeds,
            controls=[(spec.name, self._control_input(spec.image, params), spec.scale) for spec in params.controlnets],
            loras=list(loras),
            lora_step=_lora_deadline(params, len(timesteps), lora_wait_fraction),
            inpainting=initial.inpainting,
            denoiser_inputs=initial.denoiser_inputs,
            long_text=None if prompt_embeds.hidden.shape[1] == self.prompts.usual_length
            else prompt_embeds.hidden.shape[1],
        )

    def denoising_steps(self, params: GenerationParams) -> int:
        """The denoiser forwards (engine steps) ``params`` takes: its scheduler's timesteps, an edit's cut by its
        strength (a second-order scheduler such as ``heun`` takes about two per step)."""
        return len(self._schedule(params, torch.device("cpu"))[1])

    def _schedule(self, params: GenerationParams, device: torch.device) -> tuple[SchedulerMixin, torch.Tensor]:
        """The request's own scheduler, set to its steps, and the timesteps it runs (an edit's from its start)."""
        scheduler = self.schedulers.build(params.scheduler)
        scheduler.set_timesteps(params.num_inference_steps, device=device, **self._timestep_kwargs(scheduler, params))
        if params.edit is None:
            return scheduler, scheduler.timesteps
        start = edit_start(params.num_inference_steps, params.edit.strength, flow=self.schedulers.flow)
        return scheduler, edit_timesteps(scheduler, start)

    def _noise(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """Unit noise at the request's latent size, image ``i``'s drawn from generator ``i`` [n, C, h, w]."""
        shape = (1, self.vae.config.latent_channels, params.height // self.vae_scale_factor,
                 params.width // self.vae_scale_factor)
        return torch.cat([torch.randn(shape, generator=g, dtype=self.dtype) for g in generators]).to(self.device)

    def _image_latents(self, pixels: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """``pixels`` [1, 3, H, W] in [-1, 1] as denoiser latents, one sample of the VAE's latent distribution per
        generator (``retrieve_latents``) [len(generators), C, h, w]: ``(sample - shift) * scaling``."""
        distribution = self.vae.encode(pixels.to(self.device, self.vae_dtype)).latent_dist
        samples = torch.cat([distribution.sample(generator) for generator in generators]).to(self.dtype)
        return to_denoiser_latents(self.vae, samples)

    def _image_to_image(self, params: GenerationParams, edit: EditImage, scheduler: SchedulerMixin,
                        timesteps: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """The initial latents of an img2img request, as diffusers' img2img pipelines draw them: image ``i``'s
        latents sampled with generator ``i``, then its noise, noised to the first timestep."""
        image = self._image_latents(_pixels(edit.image), generators)
        return noised(scheduler, image, self._noise(params, generators), timesteps[:1].repeat(params.n))

    def _inpaint(self, params: GenerationParams, edit: EditImage, scheduler: SchedulerMixin, timesteps: torch.Tensor,
                 generators: Sequence[torch.Generator]) -> _Start:
        """An inpainting request's start, as diffusers' inpainting pipelines draw it: the image's latents sampled
        once with the first generator (a 4-channel denoiser blends them back after each step; an inpainting
        denoiser takes them only to start below strength 1), every image's noise, then the masked image's latents
        with the first generator again (an inpainting denoiser's input beside the mask; for a 4-channel one only
        the draw is made). Strength 1 starts from the noise alone."""
        assert edit.mask is not None
        pixels, mask = _pixels(edit.image), _binary_mask(edit.mask)
        takes_mask = self.inpainting_denoiser
        image = None
        if not takes_mask or edit.strength < 1.0:
            image = self._image_latents(pixels, generators[:1]).repeat(params.n, 1, 1, 1)
        noise = self._noise(params, generators)
        if edit.strength == 1.0:
            latents = noise * getattr(scheduler, "init_noise_sigma", 1.0)
        else:
            latents = noised(scheduler, image, noise, timesteps[:1].repeat(params.n))
        small = torch.nn.functional.interpolate(mask, size=noise.shape[-2:]).to(self.device, self.dtype)
        if takes_mask:
            masked = self._image_latents(pixels * (mask < 0.5), generators[:1])
            return _Start(latents, denoiser_inputs=torch.cat([small, masked], dim=1).repeat(params.rows, 1, 1, 1))
        torch.randn((1, *noise.shape[1:]), generator=generators[0], dtype=self.vae_dtype)  # the masked image's draw
        assert image is not None
        return _Start(latents, Inpainting(image, noise, small.repeat(params.n, 1, 1, 1)))

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
        worker, the unconditional rows there and the rest here, at the same time. When the worker fails or is late
        (``cfg_patience``), this engine computes its rows too (logged and counted), and every row itself while the
        worker pauses after that: the step is slower, no request fails or stalls for it. So it does the rows the
        worker skipped (their LoRAs still loading there; counted)."""
        batch = RowBatch.for_states(states)
        if self.cfg_worker is None or not any(state.params.uses_cfg for state in states):
            noise = self.predict_noise(batch)
        elif not self.cfg_patience.available():
            self.metrics.cfg_local_fallback()
            noise = self.predict_noise(batch)
        else:
            noise = self._predict_with_worker(states, batch)
        offset = 0
        for state in states:
            prediction = noise[offset:offset + state.rows]
            offset += state.rows
            if state.params.uses_cfg:
                uncond, cond = prediction.chunk(2)
                prediction = uncond + state.params.cfg_scale * (cond - uncond)
            output = state.scheduler.step(prediction, state.timesteps[state.step_index], state.latents,
                                          **step_kwargs(state.scheduler, state.generators), return_dict=True)
            state.latents = output.prev_sample
            state.x0_estimate = getattr(output, "pred_original_sample", None)
            if state.inpainting is not None:
                _put_back_kept(state, state.inpainting)
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

    def _predict_with_worker(self, states: Sequence[RequestState], batch: RowBatch) -> torch.Tensor:
        """The step's noise: the unconditional rows on the CFG worker, the rest here meanwhile; the worker's rows
        here too when it fails, is late, or skipped them."""
        remote, local, offset = [], [], 0
        for state in states:
            half = state.params.n if state.params.uses_cfg else 0
            remote += range(offset, offset + half)
            local += range(offset + half, offset + state.rows)
            offset += state.rows
        pending = self.cfg_worker.submit(batch.select(remote))
        started = time.monotonic()
        local_noise = self.predict_noise(batch.select(local))
        noise = local_noise.new_empty((batch.rows, *local_noise.shape[1:]))
        noise[local] = local_noise
        try:
            patience = self.cfg_patience.wait_s(time.monotonic() - started)
            answer = self._await_remote(lambda: pending.result(timeout=patience))
        except Exception as exc:
            pending.cancel()
            pause = self.cfg_patience.failed()
            logger.warning("CFG worker failed or late (%s: %s); computing its %d rows here, and every row for %.1fs",
                           type(exc).__name__, exc, len(remote), pause)
            self.metrics.cfg_local_fallback()
            left = remote
        else:
            self.cfg_patience.answered()
            skipped = set(answer.skipped)
            done = [row for index, row in enumerate(remote) if index not in skipped]
            if done:
                noise[done] = answer.noise.to(noise.device, noise.dtype)
            left = [remote[index] for index in answer.skipped]
            if left:
                self.metrics.cfg_lora_local_rows(len(left))
        if left:
            noise[left] = self.predict_noise(batch.select(left))
        return noise

    @torch.inference_mode()
    def decode(self, state: RequestState) -> np.ndarray:
        """The request's images as float32 [n, H, W, 3] in [0, 1]. With a CFG worker (not pausing after a failure),
        its device decodes the lower half of the rows meanwhile (``band_decode``); if it fails, this engine decodes
        the whole (logged, counted)."""
        latents = to_vae_latents(self.vae, state.latents, self.vae_dtype)
        images = None
        if (self.cfg_worker is not None and self._band_decodable and latents.shape[2] >= 2
                and self.cfg_patience.available()):
            try:
                images = decode_with_peer(self.vae, latents, self.cfg_worker.band_peer(latents))
            except Exception as exc:
                self.cfg_patience.failed()
                logger.warning("band decode with the CFG worker failed (%s: %s); decoding here", type(exc).__name__,
                               exc)
                self.metrics.band_decode("fallback")
            else:
                self.metrics.band_decode("split")
        if images is None:
            images = self.vae.decode(latents, return_dict=False)[0]
        return to_images(images)

    # -- helpers -----------------------------------------------------------------------------------

    def _await_remote(self, result: Callable[[], T]) -> T:
        """``result()`` (a remote call's answer), the time blocked on it added to ``remote_wait_s``."""
        started = time.perf_counter()
        try:
            return result()
        finally:
            self.remote_wait_s += time.perf_counter() - started

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
                                  latent_shift=vae_shift(self.vae) * self.vae.config.scaling_factor)
            pending.append((name, index, self.controlnets.submit(name, call)))

        def summed() -> ControlNetResiduals:
            down: list[torch.Tensor] = []
            mid: torch.Tensor | None = None
            single: list[torch.Tensor] = []
            for name, index, future in pending:
                try:
                    residuals = self._await_remote(future.result)
                except Exception as exc:
                    raise ControlNetUnavailable(name, exc) from exc
                if not down:
                    down = [_zero_rows(batch.rows, part, batch.sample) for part in residuals.down]
                    mid = _zero_rows(batch.rows, residuals.mid, batch.sample) if residuals.mid is not None else None
                    single = [_zero_rows(batch.rows, part, batch.sample) for part in residuals.single]
                for total, part in zip([*down, *single], [*residuals.down, *residuals.single], strict=True):
                    total.index_add_(0, index, part.to(total.device, total.dtype))
                if mid is not None and residuals.mid is not None:
                    mid.index_add_(0, index, residuals.mid.to(mid.device, mid.dtype))
            return ControlNetResiduals(down, mid, single)

        return summed

    def _control_input(self, image: np.ndarray, params: GenerationParams) -> torch.Tensor:
        """A conditioning image as the family's ControlNets take it: the image in [0, 1] [1, 3, H, W] (SD, SDXL);
        SD3 and Flux: its VAE latents ``(mode - shift) * scaling`` [1, C, h, w] (diffusers samples the latent
        distribution; the engine takes its mode, so one image conditions every row and request alike)."""
        pixels = to_controlnet_input(image, params.width, params.height).to(self.device)
        if self.info.family not in ("sd3", "flux"):
            return pixels
        return encode_mode(self.vae, pixels, self.vae_dtype).to(self.dtype)

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

    def _timestep_kwargs(self, scheduler: SchedulerMixin, params: GenerationParams) -> dict:
        """Dynamic shifting (Flux [dev], SD3.5), where ``scheduler`` shifts dynamically: the schedule's shift ``mu``
        from the image's token count, as diffusers' pipelines compute it; Flux: the sigmas ``FluxPipeline`` sets
        (1 down to 1/steps, evenly), unless the scheduler makes flow sigmas itself."""
        config, kwargs = scheduler.config, {}
        if self.info.family == "flux" and not config.get("use_flow_sigmas"):
            steps = params.num_inference_steps
            kwargs["sigmas"] = np.linspace(1.0, 1 / steps, steps)
        if config.get("use_dynamic_shifting"):
            tokens = (params.height // self.latent_factor) * (params.width // self.latent_factor)
            kwargs["mu"] = calculate_shift(tokens, config.get("base_image_seq_len", 256),
                                           config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                           config.get("max_shift", 1.16))
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


class _Start(NamedTuple):
    """A request's initial latents [n, C, h, w] and, for inpainting, what it blends in after each step (a
    4-channel denoiser) or what its denoiser takes beside them (an inpainting one)."""

    latents: torch.Tensor
    inpainting: Inpainting | None = None
    denoiser_inputs: torch.Tensor | None = None


def _lora_deadline(params: GenerationParams, steps: int, lora_wait_fraction: float) -> int:
    """The step at which a request of ``steps`` scheduler steps stops for LoRAs that are still loading."""
    if params.lora_mode == "exact":
        return 0
    return math.floor(lora_wait_fraction * steps + 1e-9)


def _invalid(param: str, message: str) -> APIError:
    """A 400 for a request field this model cannot take."""
    return APIError(400, message, param=param, code="invalid_value")


def _validate_for_inpainting_denoiser(params: GenerationParams) -> None:
    """An inpainting checkpoint's denoiser needs a mask and a masked image every step: it only inpaints, and takes
    no ControlNet."""
    if params.edit is None or params.edit.mask is None:
        raise _invalid("mask" if params.edit else "image", "this is an inpainting model: a request needs an image "
                                                             "and a mask")
    if params.controlnets:
        raise _invalid("controlnets", "ControlNets do not condition this inpainting model")


def _pixels(image: np.ndarray) -> torch.Tensor:
    """An RGB uint8 image [H, W, 3] as diffusers' ``VaeImageProcessor.preprocess`` makes it: [1, 3, H, W] in
    [-1, 1], float32."""
    scaled = torch.from_numpy(image.astype(np.float32) / 255.0).permute(2, 0, 1).unsqueeze(0)
    return 2.0 * scaled - 1.0


def _binary_mask(mask: np.ndarray) -> torch.Tensor:
    """A uint8 mask [H, W] (255: repaint) as diffusers' inpainting ``mask_processor`` makes it: [1, 1, H, W], 1
    where it is at least half way to 255, else 0, float32."""
    scaled = torch.from_numpy(mask.astype(np.float32) / 255.0)[None, None]
    return (scaled >= 0.5).to(torch.float32)


def _put_back_kept(state: RequestState, inpainting: Inpainting) -> None:
    """After a scheduler step (``state.step_index`` not yet advanced), the kept region of the source image noised
    to the next timestep (clean after the last step) replaces the latents' (diffusers' 4-channel inpainting); the
    clean-latent estimate keeps the source there too, so a preview shows it."""
    kept, mask = inpainting.image_latents, inpainting.mask
    following = state.timesteps[state.step_index + 1:state.step_index + 2]
    proper = noised(state.scheduler, kept, inpainting.noise, following) if len(following) else kept
    state.latents = (1 - mask) * proper + mask * state.latents
    if state.x0_estimate is not None:
        state.x0_estimate = (1 - mask) * kept + mask * state.x0_estimate
