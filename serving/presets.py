"""Diffusion model sources: built-in presets (built offline, seeded) and local diffusers directories.

``tiny``       a small text-to-image model (64x64 images) for tests and the default deployment.
``sd15-shape`` the Stable Diffusion 1.5 architecture with random weights: realistic compute for benchmarks.
``sdxl-tiny``  the SDXL architecture (two text encoders, pooled text and size conditioning) at the tiny sizes
               of diffusers' own SDXL tests (64x64 images).
``sdxl-shape`` the SDXL 1.0 base architecture with random weights (1024x1024 images), for benchmarks.
``sd3-tiny``   the Stable Diffusion 3 architecture (an MMDiT transformer, two CLIP encoders and a T5 encoder, a
               16-channel VAE, flow matching) at tiny sizes (64x64 images).
``flux-tiny``  the Flux.1 [dev] architecture (a Flux transformer over 2x2-packed latents, a CLIP encoder's pooled
               output and a T5 encoder, the guidance embedding, flow matching with a shift by image size) at tiny
               sizes (64x64 images).
``flux-schnell-tiny`` the same as Flux.1 [schnell] is to [dev]: no guidance embedding, an unshifted schedule.

Presets are constructed in memory from fixed configs and a seed, so two builds are bit-identical and
nothing is downloaded. Real checkpoints load from a local directory with ``local_files_only=True``, their
weights from ``.safetensors`` files only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from diffusers import (
    AutoencoderKL,
    ControlNetModel,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxControlNetModel,
    FluxControlNetPipeline,
    FluxMultiControlNetModel,
    FluxPipeline,
    FluxTransformer2DModel,
    MultiControlNetModel,
    SchedulerMixin,
    SD3ControlNetModel,
    SD3MultiControlNetModel,
    SD3Transformer2DModel,
    StableDiffusion3ControlNetPipeline,
    StableDiffusion3Pipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLControlNetPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from serving._private.tokenizer import build_t5_tokenizer, build_tokenizer
from serving.preset_catalog import WEIGHTS_CHOICES, WeightsChoice, check_preset, preset_weights

#: The model families the engine serves: Stable Diffusion 1.x/2.x (a UNet, one CLIP text encoder), SDXL (a UNet,
#: two CLIP encoders, the second's pooled embedding and the image size conditioning the UNet's added embedding),
#: Stable Diffusion 3 (an MMDiT transformer denoiser, two CLIP encoders and a T5 encoder, flow matching) and Flux.1
#: (a Flux transformer over packed latents, a CLIP encoder's pooled output and a T5 encoder, flow matching; [dev]:
#: guidance distilled into an embedding, [schnell]: none).
ModelFamily = Literal["sd", "sdxl", "sd3", "flux"]
#: The diffusers pipeline class a local directory's ``model_index.json`` names, by family.
_PIPELINE_CLASSES: dict[str, ModelFamily] = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl",
                                             "StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
#: The family's diffusers pipelines: text-to-image, and with ControlNets (the references the engine is tested on).
_PIPELINES = {"sd": (StableDiffusionPipeline, StableDiffusionControlNetPipeline),
              "sdxl": (StableDiffusionXLPipeline, StableDiffusionXLControlNetPipeline),
              "sd3": (StableDiffusion3Pipeline, StableDiffusion3ControlNetPipeline),
              "flux": (FluxPipeline, FluxControlNetPipeline)}
#: What the family's pipelines are built or loaded without: SD's safety checker, SDXL's watermarker.
_WITHOUT_EXTRAS: dict[ModelFamily, dict[str, object]] = {
    "sd": {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False},
    "sdxl": {"add_watermarker": False}}
#: A denoiser: a UNet with down, mid and up blocks (SD, SDXL), an MMDiT transformer (SD3) or a Flux transformer.
Denoiser = UNet2DConditionModel | SD3Transformer2DModel | FluxTransformer2DModel
#: Flux's native image side in latent pixels (diffusers' ``FluxPipeline.default_sample_size``).
_FLUX_SAMPLE_SIZE = 128


@dataclass
class DiffusionComponents:
    """The parts of a text-to-image latent diffusion model. SDXL adds a second CLIP text encoder with a projection
    (``text_encoder_2``); SD3 has a transformer denoiser, two CLIP encoders with projections and a T5 encoder
    (``text_encoder_3``); Flux a Flux transformer, one CLIP encoder (its pooled output) and a T5 encoder
    (``text_encoder_3`` here, diffusers' ``text_encoder_2``)."""

    denoiser: Denoiser
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizer
    scheduler: SchedulerMixin
    text_encoder_2: CLIPTextModelWithProjection | None = None
    tokenizer_2: CLIPTokenizer | None = None
    text_encoder_3: T5EncoderModel | None = None
    tokenizer_3: T5TokenizerFast | None = None
    #: SDXL: an absent negative prompt conditions on zeros, not on the empty prompt's embedding (diffusers' default)
    force_zeros_for_empty_prompt: bool = True
    #: Flux: the native image side in pixels (None: diffusers' ``default_sample_size`` times the VAE's factor)
    native_size: int | None = None

    def __post_init__(self) -> None:
        has_second = self.text_encoder_2 is not None and self.tokenizer_2 is not None
        has_third = self.text_encoder_3 is not None and self.tokenizer_3 is not None
        if isinstance(self.denoiser, SD3Transformer2DModel):
            if not (has_second and has_third):
                raise ValueError("an SD3 transformer needs text_encoder_2, tokenizer_2, text_encoder_3 and tokenizer_3")
            return
        if isinstance(self.denoiser, FluxTransformer2DModel):
            if not has_third or self.text_encoder_2 is not None:
                raise ValueError("a Flux transformer needs a T5 encoder (text_encoder_3, tokenizer_3) beside its CLIP "
                                 "encoder, and no second CLIP encoder")
            return
        if self.text_encoder_3 is not None:
            raise ValueError("only an SD3 or Flux transformer takes text_encoder_3 and tokenizer_3")
        sdxl = self.denoiser.config.addition_embed_type == "text_time"
        if sdxl != has_second:
            raise ValueError("an SDXL UNet (addition_embed_type 'text_time') needs text_encoder_2 and tokenizer_2, "
                             "and only it takes them")

    @property
    def family(self) -> ModelFamily:
        if isinstance(self.denoiser, SD3Transformer2DModel):
            return "sd3"
        if isinstance(self.denoiser, FluxTransformer2DModel):
            return "flux"
        return "sdxl" if self.text_encoder_2 is not None else "sd"

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_factor(self) -> int:
        """Image pixels per denoiser position along a side: the VAE's factor, times the transformer's patch (Flux:
        its 2x2 packing of the latents)."""
        if self.family == "flux":
            return self.vae_scale_factor * 2
        return self.vae_scale_factor * getattr(self.denoiser.config, "patch_size", 1)

    @property
    def default_size(self) -> int:
        """Native image side in pixels."""
        if self.family == "flux":
            return self.native_size or _FLUX_SAMPLE_SIZE * self.vae_scale_factor
        return self.denoiser.config.sample_size * self.vae_scale_factor

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this: 8, as diffusers' pipelines require, or a coarser latent grid."""
        return max(8, self.latent_factor)

    @property
    def max_side(self) -> int | None:
        """The largest image side the denoiser takes (SD3: its positional embedding's grid), or None."""
        grid = getattr(self.denoiser.config, "pos_embed_max_size", None)
        return grid * self.latent_factor if grid is not None else None

    def modules(self) -> dict[str, torch.nn.Module]:
        modules = {"denoiser": self.denoiser, "vae": self.vae, "text_encoder": self.text_encoder}
        for name in ("text_encoder_2", "text_encoder_3"):
            if getattr(self, name) is not None:
                modules[name] = getattr(self, name)
        return modules

    def freeze(self) -> DiffusionComponents:
        """Inference mode for every module: eval, no gradients. Weights are shared, never trained here."""
        for module in self.modules().values():
            module.eval().requires_grad_(False)
        return self

    def as_pipeline(self) -> DiffusionPipeline:
        """The family's diffusers pipeline over these same modules (no copies), without a safety checker."""
        return _PIPELINES[self.family][0](**self._pipeline_parts())

    def as_controlnet_pipeline(self, controlnets: Sequence[ControlNetModel | SD3ControlNetModel | FluxControlNetModel]
                               ) -> DiffusionPipeline:
        """The family's diffusers ControlNet pipeline over these modules (the reference our engine is tested
        against); several ControlNets are combined by ``MultiControlNetModel`` (SD3: ``SD3MultiControlNetModel``,
        Flux: ``FluxMultiControlNetModel``), as diffusers does."""
        multi = {"sd3": SD3MultiControlNetModel, "flux": FluxMultiControlNetModel}.get(self.family,
                                                                                       MultiControlNetModel)
        controlnet = controlnets[0] if len(controlnets) == 1 else multi(list(controlnets))
        return _PIPELINES[self.family][1](**self._pipeline_parts(), controlnet=controlnet)

    def _pipeline_parts(self) -> dict:
        """The constructor arguments the family's diffusers pipelines share (SD: no safety checker; SDXL: no
        watermarker)."""
        parts = {"vae": self.vae, "text_encoder": self.text_encoder, "tokenizer": self.tokenizer,
                 "scheduler": self.scheduler}
        if self.family == "sd3":
            return parts | {"transformer": self.denoiser, "text_encoder_2": self.text_encoder_2,
                            "tokenizer_2": self.tokenizer_2, "text_encoder_3": self.text_encoder_3,
                            "tokenizer_3": self.tokenizer_3}
        if self.family == "flux":
            return parts | {"transformer": self.denoiser, "text_encoder_2": self.text_encoder_3,
                            "tokenizer_2": self.tokenizer_3}
        parts |= {"unet": self.denoiser, **_WITHOUT_EXTRAS[self.family]}
        if self.family == "sdxl":
            return parts | {"text_encoder_2": self.text_encoder_2, "tokenizer_2": self.tokenizer_2,
                            "force_zeros_for_empty_prompt": self.force_zeros_for_empty_prompt}
        return parts


def _sd_scheduler() -> DDIMScheduler:
    """DDIM with Stable Diffusion 1.x's noise schedule."""
    return DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def _sdxl_scheduler() -> EulerDiscreteScheduler:
    """Euler with SDXL 1.0's noise schedule and ``leading`` timestep spacing. Its tables are made on the CPU even
    where modules are built on another default device (``meta``, to size a preset without its memory)."""
    with torch.device("cpu"):
        return EulerDiscreteScheduler(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
        )


def _sd3_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Flow-matching Euler with SD3's timestep shift (3.0), its tables made on the CPU."""
    with torch.device("cpu"):
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def _flux_scheduler(*, distilled: bool = True) -> FlowMatchEulerDiscreteScheduler:
    """Flow-matching Euler as Flux.1 ships it: [dev] shifts the schedule by the image's token count (``mu``), from
    0.5 at 256 tokens to 1.15 at 4096; [schnell] does not shift. Its tables are made on the CPU."""
    with torch.device("cpu"):
        if not distilled:
            return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                               base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                               max_image_seq_len=4096)


def _text_config(tokenizer: CLIPTokenizer, **arch: int | str) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch,
    )


def _text_encoder(tokenizer: CLIPTokenizer, **arch: int | str) -> CLIPTextModel:
    return CLIPTextModel(_text_config(tokenizer, **arch))


def _vae(block_out_channels: tuple[int, ...], **arch: int | float | bool) -> AutoencoderKL:
    """A Stable Diffusion VAE: RGB images, 4 latent channels unless ``arch`` says otherwise, one down/up stage per
    block."""
    stages = len(block_out_channels)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * stages,
                         up_block_types=("UpDecoderBlock2D",) * stages, block_out_channels=block_out_channels,
                         **{"latent_channels": 4} | arch)


def _build_tiny() -> DiffusionComponents:
    tokenizer = build_tokenizer()
    return DiffusionComponents(
        denoiser=UNet2DConditionModel(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64, 128),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=64,
            attention_head_dim=8,
            norm_num_groups=32,
        ),
        vae=_vae((16, 32, 64), sample_size=64, layers_per_block=1, norm_num_groups=8),
        text_encoder=_text_encoder(
            tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        ),
        tokenizer=tokenizer,
        scheduler=_sd_scheduler(),
    )


def _build_sd15_shape() -> DiffusionComponents:
    tokenizer = build_tokenizer()
    return DiffusionComponents(
        denoiser=UNet2DConditionModel(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            block_out_channels=(320, 640, 1280, 1280),
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
        ),
        vae=_vae((128, 256, 512, 512), sample_size=512, layers_per_block=2),
        text_encoder=_text_encoder(
            tokenizer, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
        ),
        tokenizer=tokenizer,
        scheduler=_sd_scheduler(),
    )


def _sdxl_unet(**arch) -> UNet2DConditionModel:
    """An SDXL UNet: linear projections in its transformers, the pooled text embedding and six size numbers
    (original size, crop corner, target size) added to the time embedding."""
    return UNet2DConditionModel(
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(arch["block_out_channels"]) - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (len(arch["block_out_channels"]) - 1) + ("UpBlock2D",),
        use_linear_projection=True,
        addition_embed_type="text_time",
        **arch,
    )


def _build_sdxl_tiny() -> DiffusionComponents:
    """SDXL at the tiny sizes of diffusers' tests, the second text encoder wider than the first as SDXL's (and so
    a single-file checkpoint tells them apart by width, as it tells CLIP ViT-L from OpenCLIP bigG)."""
    tokenizer = build_tokenizer()
    text = {"intermediate_size": 37, "num_hidden_layers": 5, "num_attention_heads": 4, "hidden_act": "gelu"}
    return DiffusionComponents(
        denoiser=_sdxl_unet(
            sample_size=32,
            block_out_channels=(32, 64),
            layers_per_block=2,
            attention_head_dim=(2, 4),
            transformer_layers_per_block=(1, 2),
            cross_attention_dim=80,  # the two text encoders' hidden states (32 + 48), concatenated
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=96,  # 6 size numbers x 8 + the pooled embedding's 48
        ),
        vae=_vae((32, 64), sample_size=128, scaling_factor=0.13025),
        text_encoder=_text_encoder(tokenizer, hidden_size=32, projection_dim=32, **text),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_text_config(tokenizer, hidden_size=48, projection_dim=48,
                                                                **text)),
        tokenizer_2=build_tokenizer(),
        scheduler=_sdxl_scheduler(),
    )


#: The SDXL 1.0 base UNet's architecture (``_sdxl_unet`` arguments of the ``sdxl-shape`` preset).
_SDXL_SHAPE_UNET = {
    "sample_size": 128,
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "attention_head_dim": (5, 10, 20),
    "transformer_layers_per_block": (1, 2, 10),
    "cross_attention_dim": 2048,  # CLIP ViT-L (768) + OpenCLIP ViT-bigG (1280)
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,  # 6 x 256 + 1280
}


def sdxl_shape_unet() -> UNet2DConditionModel:
    """The ``sdxl-shape`` preset's UNet alone, random weights (built under ``torch.device("meta")``: shapes only)."""
    return _sdxl_unet(**_SDXL_SHAPE_UNET)


def _build_sdxl_shape() -> DiffusionComponents:
    tokenizer = build_tokenizer()
    return DiffusionComponents(
        denoiser=sdxl_shape_unet(),
        vae=_vae((128, 256, 512, 512), sample_size=1024, layers_per_block=2, scaling_factor=0.13025),
        text_encoder=_text_encoder(tokenizer, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                   num_attention_heads=12),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_text_config(
            tokenizer, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
            hidden_act="gelu", projection_dim=1280)),
        tokenizer_2=build_tokenizer(),
        scheduler=_sdxl_scheduler(),
    )


def _build_sd3_tiny() -> DiffusionComponents:
    """SD3 at tiny sizes: the CLIP encoders' penultimate states (32 + 32 wide, zero-padded) and the T5 encoder's
    (64 wide) form one context sequence of width ``joint_attention_dim``; their pooled projections (32 + 32) the
    transformer's ``pooled_projection_dim``."""
    tokenizer = build_tokenizer()
    clip = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 5, "num_attention_heads": 4,
            "hidden_act": "gelu", "projection_dim": 32}
    tokenizer_3 = build_t5_tokenizer()
    return DiffusionComponents(
        denoiser=SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=32,  # the transformer's width: heads x head dim
            pooled_projection_dim=64,
            pos_embed_max_size=32,
        ),
        vae=_vae((16, 32, 64), sample_size=64, layers_per_block=1, norm_num_groups=8, latent_channels=16,
                 use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=CLIPTextModelWithProjection(_text_config(tokenizer, **clip)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_text_config(tokenizer, **clip)),
        tokenizer_2=build_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=tokenizer_3.pad_token_id,
            eos_token_id=tokenizer_3.eos_token_id)),
        tokenizer_3=tokenizer_3,
        scheduler=_sd3_scheduler(),
    )


def _build_flux_tiny(*, guidance_embeds: bool = True) -> DiffusionComponents:
    """Flux.1 at tiny sizes: the CLIP encoder's pooled output (32 wide) is the transformer's pooled projection, the
    T5 encoder's states (32 wide) its context; a 4-channel VAE whose latents pack 2x2 into 16 channels.
    ``guidance_embeds=False``: a [schnell]-style model (no guidance embedding, an unshifted schedule)."""
    tokenizer = build_tokenizer()
    tokenizer_3 = build_t5_tokenizer()
    return DiffusionComponents(
        denoiser=FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,  # 4 latent channels x a 2x2 patch
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 6, 6),  # sums to the head dim
        ),
        vae=_vae((16, 32, 64), sample_size=64, layers_per_block=1, norm_num_groups=8, use_quant_conv=False,
                 use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_text_encoder(tokenizer, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                   num_attention_heads=4, hidden_act="gelu"),
        tokenizer=tokenizer,
        text_encoder_3=T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=tokenizer_3.pad_token_id,
            eos_token_id=tokenizer_3.eos_token_id)),
        tokenizer_3=tokenizer_3,
        scheduler=_flux_scheduler(distilled=guidance_embeds),
        native_size=64,
    )


#: The builder of each preset in ``serving.preset_catalog.PRESET_NAMES``.
_BUILDERS: dict[str, Callable[[], DiffusionComponents]] = {
    "tiny": _build_tiny,
    "sd15-shape": _build_sd15_shape,
    "sdxl-tiny": _build_sdxl_tiny,
    "sdxl-shape": _build_sdxl_shape,
    "sd3-tiny": _build_sd3_tiny,
    "flux-tiny": _build_flux_tiny,
    "flux-schnell-tiny": lambda: _build_flux_tiny(guidance_embeds=False),
}


def build_preset(name: str, seed: int = 0, *, weights: WeightsChoice = "seeded") -> DiffusionComponents:
    """Build preset ``name``: ``seeded`` draws its weights from ``seed`` (the global RNG state is left
    untouched); ``auto`` loads the preset's shipped trained weights where it has some, else seeds."""
    check_preset(name)
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS_CHOICES)}, got {weights!r}")
    trained = preset_weights(name) if weights == "auto" else None
    if trained is not None:
        return load_local(trained)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components = _BUILDERS[name]()
    return components.freeze()


def local_family(path: str | Path) -> ModelFamily:
    """The family of a diffusers text-to-image directory, from the pipeline class its ``model_index.json`` names;
    ValueError for a directory that is not one, or a pipeline this engine does not serve."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise ValueError(f"{path} is not a diffusers model directory (no model_index.json)")
    try:
        pipeline = json.loads(index.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{index}: not a JSON object") from exc
    if pipeline not in _PIPELINE_CLASSES:
        raise ValueError(f"{index}: pipeline {pipeline!r} is not served; served: {', '.join(_PIPELINE_CLASSES)}")
    return _PIPELINE_CLASSES[pipeline]


def load_local(path: str | Path) -> DiffusionComponents:
    """Load a diffusers SD, SDXL, SD3 or Flux text-to-image directory from local disk only (never a hub), its
    weights from ``.safetensors`` files only (a pickled ``.bin`` is refused unopened: pickle can run code)."""
    family = local_family(path)
    pipeline_cls, without = pipeline_loader(family)
    pipe = pipeline_cls.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=torch.float32,
                                        **without)
    return components_of(pipe, family)


def pipeline_loader(family: ModelFamily) -> tuple[type[DiffusionPipeline], dict[str, object]]:
    """The family's text-to-image pipeline class and the arguments its loads take to leave out SD's safety checker
    and SDXL's watermarker."""
    return _PIPELINES[family][0], _WITHOUT_EXTRAS.get(family, {})


def components_of(pipe: DiffusionPipeline, family: ModelFamily) -> DiffusionComponents:
    """The components of ``family``'s diffusers pipeline ``pipe`` (the same modules), frozen."""
    extras: dict = {}
    if family == "flux":
        extras = {"denoiser": pipe.transformer, "text_encoder_3": pipe.text_encoder_2, "tokenizer_3": pipe.tokenizer_2}
    elif family == "sd3":
        extras = {"denoiser": pipe.transformer, "text_encoder_2": pipe.text_encoder_2, "tokenizer_2": pipe.tokenizer_2,
                  "text_encoder_3": pipe.text_encoder_3, "tokenizer_3": pipe.tokenizer_3}
    elif family == "sdxl":
        extras = {"denoiser": pipe.unet, "text_encoder_2": pipe.text_encoder_2, "tokenizer_2": pipe.tokenizer_2,
                  "force_zeros_for_empty_prompt": bool(pipe.config.force_zeros_for_empty_prompt)}
    else:
        extras = {"denoiser": pipe.unet}
    return DiffusionComponents(
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        scheduler=pipe.scheduler,
        **extras,
    ).freeze()
