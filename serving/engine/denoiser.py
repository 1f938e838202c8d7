"""The diffusion engine: an explicit denoising step loop on diffusers components.

Numerically it follows ``StableDiffusionPipeline`` (same tokenisation, noise, scheduler calls, CFG
and decoding), but the state lives in ``RequestState`` objects, so one UNet forward can serve rows
from many requests, each at its own timestep, with its own LoRAs, guidance and scheduler.
"""

from __future__ import annotations

import inspect
import io
import math
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from serving.common.device import placement, resolve_device
from serving.common.logging import get_logger
from serving.config import DiffusionModelConfig, LoRAConfig
from serving.engine.request import PendingLoRA, RequestState
from serving.engine.types import GenerationParams, ModelInfo
from serving.lora.apply import LoRAHooks, plan_lora_rows
from serving.lora.format import LoRATargets
from serving.lora.weights import LoRAWeights
from serving.presets import DiffusionComponents, build_preset, load_local

logger = get_logger("engine")

_DEVICE_LORA_COPIES = 16

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_components(config: DiffusionModelConfig) -> DiffusionComponents:
    """Build a preset or load a local directory, as ``config`` says."""
    if config.preset is not None:
        return build_preset(config.preset, seed=config.seed)
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
                 lora_merge_after: int = 8) -> None:
        self.info = ModelInfo(name=name, default_size=components.default_size,
                              size_multiple=components.size_multiple)
        self.device, self.dtype = device, dtype
        for module in components.modules().values():
            module.to(device)
            if dtype != torch.float32:
                module.to(dtype)
        self.unet, self.vae, self.text_encoder = components.unet, components.vae, components.text_encoder
        self.tokenizer, self.base_scheduler = components.tokenizer, components.scheduler
        self.vae_scale_factor = components.vae_scale_factor
        self.lora_targets = LoRATargets.from_modules(self.unet, self.text_encoder)
        # The UNet runs every step: a merged copy can pay off. The text encoder runs once per request: never merge.
        self._unet_loras = LoRAHooks(self.unet, merged_cache_bytes=merged_lora_bytes, merge_after=lora_merge_after)
        self._text_loras = LoRAHooks(self.text_encoder)
        self._device_loras: OrderedDict[int, tuple[LoRAWeights, LoRAWeights]] = OrderedDict()
        step_parameters = set(inspect.signature(self.base_scheduler.step).parameters)
        self._step_takes_eta = "eta" in step_parameters
        self._step_takes_generator = "generator" in step_parameters

    @classmethod
    def from_config(cls, config: DiffusionModelConfig, lora: LoRAConfig | None = None) -> DiffusionEngine:
        device = resolve_device(config.device)
        lora = lora or LoRAConfig()
        started = time.perf_counter()
        engine = cls(config.name, load_components(config), device, DTYPES[config.dtype],
                     merged_lora_bytes=lora.merged_cache_bytes, lora_merge_after=lora.merge_after_forwards)
        source = f"preset={config.preset}" if config.preset else f"path={config.path}"
        logger.info("diffusion model %r loaded (%s, device=%s, dtype=%s) in %.1fs on %s",
                    config.name, source, device, config.dtype, time.perf_counter() - started, placement())
        return engine

    # -- request lifecycle -------------------------------------------------------------------------

    def validate(self, params: GenerationParams) -> None:
        multiple = self.info.size_multiple
        if params.width % multiple or params.height % multiple:
            raise ValueError(f"width and height must be multiples of {multiple}")

    @torch.inference_mode()
    def start(self, params: GenerationParams, loras: Sequence[PendingLoRA] = (),
              lora_wait_fraction: float = 0.4) -> RequestState:
        """Tokenise and encode the prompts, draw the initial noise, set up the request's own scheduler."""
        self.validate(params)
        scheduler = type(self.base_scheduler).from_config(self.base_scheduler.config)
        scheduler.set_timesteps(params.num_inference_steps, device=self.device)
        generators = [torch.Generator("cpu").manual_seed(params.seed + i) for i in range(params.n)]
        prompt_embeds, negative_embeds = self._encode_text(params, [])
        shape = (1, self.unet.config.in_channels, params.height // self.vae_scale_factor,
                 params.width // self.vae_scale_factor)
        noise = [torch.randn(shape, generator=g, dtype=prompt_embeds.dtype) for g in generators]
        latents = torch.cat(noise).to(self.device) * scheduler.init_noise_sigma
        return RequestState(
            params=params,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            latents=latents,
            generators=generators,
            prompt_embeds=prompt_embeds,
            negative_embeds=negative_embeds,
            loras=list(loras),
            lora_step=math.floor(lora_wait_fraction * params.num_inference_steps + 1e-9),
        )

    @torch.inference_mode()
    def activate_loras(self, state: RequestState) -> None:
        """Apply the request's (loaded) LoRAs from its next step on; re-encode text if they touch the encoder."""
        state.active_loras = [(self._on_device(pending.load.result()), pending.scale) for pending in state.loras]
        for weights, _ in state.active_loras:
            self._unet_loras.ensure_hooks(weights.unet)
            self._text_loras.ensure_hooks(weights.text_encoder)
        text_pairs = [(weights.text_encoder, scale) for weights, scale in state.active_loras if weights.text_encoder]
        if text_pairs:
            state.prompt_embeds, state.negative_embeds = self._encode_text(state.params, text_pairs)
        state.lora_applied_at = state.step_index

    @torch.inference_mode()
    def step(self, states: Sequence[RequestState]) -> None:
        """One denoising step for every request in ``states``, all rows in one UNet forward."""
        samples, embeds, timesteps, assignments = [], [], [], []
        for state in states:
            t = state.timesteps[state.step_index]
            latents = torch.cat([state.latents] * 2) if state.params.uses_cfg else state.latents
            samples.append(state.scheduler.scale_model_input(latents, t))
            if state.negative_embeds is not None:
                embeds.append(torch.cat([state.negative_embeds, state.prompt_embeds]))
            else:
                embeds.append(state.prompt_embeds)
            timesteps.append(t.expand(state.rows))
            unet_pairs = [(weights.unet, scale) for weights, scale in state.active_loras]
            assignments.extend([unet_pairs] * state.rows)
        with self._unet_loras.active(plan_lora_rows(assignments, self.device)):
            noise = self.unet(torch.cat(samples), torch.cat(timesteps),
                              encoder_hidden_states=torch.cat(embeds), return_dict=False)[0]
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
    def decode(self, state: RequestState) -> np.ndarray:
        """The request's images as float32 [n, H, W, 3] in [0, 1]."""
        images = self.vae.decode(state.latents / self.vae.config.scaling_factor, return_dict=False)[0]
        return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()

    # -- helpers -----------------------------------------------------------------------------------

    def _on_device(self, weights: LoRAWeights) -> LoRAWeights:
        """One device copy per cached LoRA, shared by the requests using it (same objects: same batch group)."""
        entry = self._device_loras.get(id(weights))
        if entry is None or entry[0] is not weights:
            entry = (weights, weights.to(self.device, self.dtype))
            self._device_loras[id(weights)] = entry
            while len(self._device_loras) > _DEVICE_LORA_COPIES:
                self._device_loras.popitem(last=False)
        self._device_loras.move_to_end(id(weights))
        return entry[1]

    def _step_kwargs(self, state: RequestState) -> dict:
        kwargs: dict = {}
        if self._step_takes_eta:
            kwargs["eta"] = 0.0
        if self._step_takes_generator:
            kwargs["generator"] = state.generators
        return kwargs

    def _encode_text(self, params: GenerationParams,
                     lora_pairs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt (and, with CFG, negative prompt) embeddings, each repeated for the request's n images."""
        texts = [params.prompt]
        if params.uses_cfg:
            texts.append(params.negative_prompt or "")
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                truncation=True, return_tensors="pt")
        use_mask = getattr(self.text_encoder.config, "use_attention_mask", False)
        mask = tokens.attention_mask.to(self.device) if use_mask else None
        with self._text_loras.active(plan_lora_rows([lora_pairs] * len(texts), self.device)):
            encoded = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0]
        encoded = encoded.to(self.dtype).repeat_interleave(params.n, dim=0)
        if params.uses_cfg:
            return encoded[:params.n], encoded[params.n:]
        return encoded, None
