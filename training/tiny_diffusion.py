"""Training the ``tiny`` text-to-image model, its ControlNet and two LoRAs on the shapes world (CPU, seeded).

Stages ``vae``, ``text_to_image``, ``controlnet`` and ``lora`` each start from the previous stage's weights;
``ship`` writes the fp16 preset directory (``serving/weights/tiny/``) and ``evaluate`` measures it. Every stage
draws images and noise from its own seeded streams, so a run is reproducible on one machine (float reductions may
differ across CPUs). ``python -m training.tiny_diffusion`` runs the stages.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.training_utils import EMAModel, compute_snr
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from serving._private.tokenizer import MODEL_MAX_LENGTH
from serving.controlnet.models import build_controlnet_preset, load_controlnet
from serving.preset_catalog import WEIGHTS_ROOT
from serving.presets import DiffusionComponents, build_preset, load_local
from training.shapes.evaluation import evaluate_pipelines
from training.shapes.world import BASE_WORLD, STYLE_WORLDS, ShapeSample, ShapesWorld, short_caption

#: Modules a style LoRA adapts: attention projections and the ResNet convolutions of every block.
LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "proj_in", "proj_out")


@dataclass(frozen=True)
class StageSettings:
    """Optimisation settings of one stage."""

    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int = 100
    ema_decay: float | None = None  # None: no EMA

    def learning_rate_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of the peak."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.learning_rate * (0.1 + 0.45 * (1 + np.cos(np.pi * min(1.0, progress))))


@dataclass(frozen=True)
class TrainingSettings:
    """A whole run; recorded in ``training.json`` beside the weights."""

    seed: int = 0
    vae: StageSettings = StageSettings(steps=1200, batch_size=16, learning_rate=1e-3)
    vae_kl_weight: float = 1e-6
    pool_size: int = 32_768  # samples encoded once for text-to-image (half for the ControlNet, a quarter per LoRA)
    text_to_image: StageSettings = StageSettings(steps=6000, batch_size=32, learning_rate=1e-3, ema_decay=0.999)
    controlnet: StageSettings = StageSettings(steps=1500, batch_size=32, learning_rate=5e-4, ema_decay=0.995)
    lora: StageSettings = StageSettings(steps=1500, batch_size=32, learning_rate=2e-3)
    lora_rank: int = 8
    caption_dropout: float = 0.1
    controlnet_caption_dropout: float = 0.5
    short_caption_fraction: float = 0.5
    offset_noise: float = 0.1
    snr_gamma: float = 5.0


class ShapeBatches:
    """Endless seeded batches of a world's samples (stream ``stream``, indices 0, 1, 2, ...)."""

    def __init__(self, world: ShapesWorld, stream: int, batch_size: int) -> None:
        self.world, self.stream, self.batch_size = world, stream, batch_size
        self._next = 0

    def __iter__(self) -> Iterator[list[ShapeSample]]:
        while True:
            samples = [self.world.sample(self.stream, self._next + i) for i in range(self.batch_size)]
            self._next += self.batch_size
            yield samples


class LatentPool:
    """A fixed pool of samples with their latents encoded once; batches drawn in seeded random order
    (a frozen VAE makes re-encoding every step wasted work)."""

    def __init__(self, vae: AutoencoderKL, world: ShapesWorld, stream: int, size: int, batch_size: int) -> None:
        self.samples = world.generate(size, seed=stream)
        self.latents = torch.cat([encode_latents(vae, images_tensor(self.samples[i:i + 256]))
                                  for i in range(0, size, 256)])
        self.batch_size = batch_size
        self._rng = np.random.default_rng(stream)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, list[ShapeSample]]]:
        while True:
            order = self._rng.permutation(len(self.samples))
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                index = order[start:start + self.batch_size]
                yield self.latents[torch.from_numpy(index)], [self.samples[i] for i in index]


def images_tensor(samples: Sequence[ShapeSample]) -> torch.Tensor:
    """[B, 3, H, W] float32 in [-1, 1], as the VAE sees images."""
    array = np.stack([sample.image for sample in samples]).astype(np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


def edges_tensor(samples: Sequence[ShapeSample]) -> torch.Tensor:
    """[B, 3, H, W] float32 in [0, 1]: the canny maps as ControlNet inputs (white edges on black)."""
    array = np.stack([sample.control("canny") for sample in samples]).astype(np.float32) / 255.0
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


class TextEncoding:
    """Tokenizes and encodes captions exactly as the pipeline does (pad to 77, last hidden state)."""

    def __init__(self, components: DiffusionComponents) -> None:
        self.components = components
        self._ids: dict[str, torch.Tensor] = {}

    def ids(self, captions: Sequence[str]) -> torch.Tensor:
        missing = [text for text in dict.fromkeys(captions) if text not in self._ids]
        if missing:
            tokens = self.components.tokenizer(
                missing, padding="max_length", max_length=MODEL_MAX_LENGTH, truncation=True, return_tensors="pt")
            self._ids.update(zip(missing, tokens.input_ids, strict=True))
        return torch.stack([self._ids[text] for text in captions])

    def __call__(self, captions: Sequence[str]) -> torch.Tensor:
        return self.components.text_encoder(self.ids(captions))[0]


def choose_captions(samples: Sequence[ShapeSample], rng: np.random.Generator, *, dropout: float,
                    short_fraction: float) -> list[str]:
    """Each sample's caption, long or short at random, or "" with probability ``dropout``."""
    captions = []
    for sample in samples:
        draw = rng.random()
        if draw < dropout:
            captions.append("")
        elif rng.random() < short_fraction:
            captions.append(short_caption(sample.attributes))
        else:
            captions.append(sample.caption)
    return captions


class _Progress:
    """One line every ``every`` steps: stage, step, mean loss since the last line, elapsed seconds."""

    def __init__(self, stage: str, steps: int, log: Callable[[str], None], every: int = 100) -> None:
        self.stage, self.steps, self.log, self.every = stage, steps, log, every
        self.start = time.perf_counter()
        self.losses: list[float] = []
        self.curve: list[tuple[int, float]] = []

    def step(self, step: int, loss: float) -> None:
        self.losses.append(loss)
        if (step + 1) % self.every == 0 or step + 1 == self.steps:
            mean = float(np.mean(self.losses))
            self.curve.append((step + 1, mean))
            self.log(f"[{self.stage}] step {step + 1}/{self.steps} loss {mean:.4f} "
                     f"({time.perf_counter() - self.start:.0f} s)")
            self.losses = []

    def summary(self) -> dict[str, Any]:
        return {"seconds": round(time.perf_counter() - self.start, 1), "loss_curve": self.curve}


def _optimise(
    stage: str, settings: StageSettings, parameters: list[torch.nn.Parameter],
    loss_at: Callable[[int], torch.Tensor], log: Callable[[str], None],
) -> tuple[dict[str, Any], EMAModel | None]:
    """AdamW over ``parameters`` for ``settings.steps``; an EMA of them when the stage asks for one."""
    optimiser = torch.optim.AdamW(parameters, lr=settings.learning_rate, weight_decay=1e-4)
    ema = EMAModel(parameters, decay=settings.ema_decay, use_ema_warmup=True) if settings.ema_decay else None
    progress = _Progress(stage, settings.steps, log)
    for step in range(settings.steps):
        for group in optimiser.param_groups:
            group["lr"] = settings.learning_rate_at(step)
        loss = loss_at(step)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimiser.step()
        if ema is not None:
            ema.step(parameters)
        progress.step(step, loss.item())
    return progress.summary(), ema


def train_vae(vae: AutoencoderKL, settings: TrainingSettings, log: Callable[[str], None]) -> dict[str, Any]:
    """The preset's VAE (64x64 RGB <-> 16x16x4) on every style and background: L1 + MSE reconstruction with a small
    KL term; then ``scaling_factor`` is set to 1 / std of the latents."""
    vae.train().requires_grad_(True)
    batches = iter(ShapeBatches(ShapesWorld(), stream=settings.seed * 10 + 1, batch_size=settings.vae.batch_size))
    noise = torch.Generator().manual_seed(settings.seed * 10 + 1)

    def loss_at(_: int) -> torch.Tensor:
        images = images_tensor(next(batches))
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample(noise)).sample
        return (F.l1_loss(reconstruction, images) + F.mse_loss(reconstruction, images)
                + settings.vae_kl_weight * posterior.kl().mean())

    summary, _ = _optimise("vae", settings.vae, list(vae.parameters()), loss_at, log)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        held_out = ShapesWorld().generate(256, seed=settings.seed * 10 + 9)
        images = images_tensor(held_out)
        latents = vae.encode(images).latent_dist.mode()
        reconstruction = vae.decode(latents).sample.clamp(-1, 1)
    scaling = float(1.0 / latents.std())
    vae.register_to_config(scaling_factor=scaling)
    mean_abs = float((reconstruction - images).abs().mean() * 127.5)
    log(f"[vae] held-out mean absolute error {mean_abs:.2f} / 255; scaling_factor {scaling:.4f}")
    return {**summary, "heldout_mean_abs_error_255": round(mean_abs, 3), "scaling_factor": scaling}


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """Scaled latents (the posterior's mode), as the diffusion stages train on."""
    return vae.encode(images).latent_dist.mode() * vae.config.scaling_factor


class _DenoisingLoss:
    """Epsilon-prediction loss at random timesteps with offset noise and Min-SNR-gamma weights."""

    def __init__(self, components: DiffusionComponents, settings: TrainingSettings, seed: int) -> None:
        self.scheduler = components.scheduler
        self.settings = settings
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, latents: torch.Tensor,
                 predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        batch = latents.shape[0]
        noise = torch.randn(latents.shape, generator=self.generator)
        noise += self.settings.offset_noise * torch.randn((batch, latents.shape[1], 1, 1), generator=self.generator)
        timesteps = torch.randint(0, self.scheduler.config.num_train_timesteps, (batch,), generator=self.generator)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        per_sample = F.mse_loss(predict(noisy, timesteps), noise, reduction="none").mean(dim=(1, 2, 3))
        snr = compute_snr(self.scheduler, timesteps)
        weights = snr.clamp(max=self.settings.snr_gamma) / snr
        return (per_sample * weights).mean()


def train_text_to_image(components: DiffusionComponents, settings: TrainingSettings,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """The UNet and the text encoder, jointly, on filled shapes on white: epsilon prediction with Min-SNR weights,
    offset noise (so a dark image is reachable from pure noise), empty captions for classifier-free guidance, long
    and short captions, and an EMA of the weights."""
    unet, text_encoder, vae = components.denoiser, components.text_encoder, components.vae
    unet.train().requires_grad_(True)
    text_encoder.train().requires_grad_(True)
    stage = settings.text_to_image
    batches = iter(LatentPool(vae, BASE_WORLD, settings.seed * 10 + 2, settings.pool_size, stage.batch_size))
    rng = np.random.default_rng((settings.seed, 2))
    encode = TextEncoding(components)
    denoising = _DenoisingLoss(components, settings, seed=settings.seed * 10 + 2)

    def loss_at(_: int) -> torch.Tensor:
        latents, samples = next(batches)
        captions = choose_captions(samples, rng, dropout=settings.caption_dropout,
                                   short_fraction=settings.short_caption_fraction)
        states = encode(captions)
        return denoising(latents, lambda noisy, t: unet(noisy, t, states).sample)

    parameters = [*unet.parameters(), *text_encoder.parameters()]
    summary, ema = _optimise("text_to_image", stage, parameters, loss_at, log)
    assert ema is not None
    ema.copy_to(parameters)
    unet.eval().requires_grad_(False)
    text_encoder.eval().requires_grad_(False)
    return summary


def train_controlnet(components: DiffusionComponents, settings: TrainingSettings,
                     log: Callable[[str], None]) -> tuple[ControlNetModel, dict[str, Any]]:
    """A canny-edge ControlNet copied from the frozen UNet (zero convolutions zero); half the captions are empty so
    the edges alone suffice."""
    components.freeze()
    controlnet = build_controlnet_preset("tiny", zero_init=True, denoiser=components.denoiser)
    controlnet.train().requires_grad_(True)
    stage = settings.controlnet
    batches = iter(LatentPool(components.vae, BASE_WORLD, settings.seed * 10 + 3, settings.pool_size // 2,
                              stage.batch_size))
    rng = np.random.default_rng((settings.seed, 3))
    encode = TextEncoding(components)
    denoising = _DenoisingLoss(components, settings, seed=settings.seed * 10 + 3)

    def loss_at(_: int) -> torch.Tensor:
        latents, samples = next(batches)
        with torch.no_grad():
            states = encode(choose_captions(samples, rng, dropout=settings.controlnet_caption_dropout,
                                            short_fraction=settings.short_caption_fraction))
        condition = edges_tensor(samples)

        def predict(noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
            down, mid = controlnet(noisy, timesteps, states, controlnet_cond=condition, return_dict=False)
            return components.denoiser(noisy, timesteps, states, down_block_additional_residuals=down,
                                   mid_block_additional_residual=mid).sample

        return denoising(latents, predict)

    parameters = list(controlnet.parameters())
    summary, ema = _optimise("controlnet", stage, parameters, loss_at, log)
    assert ema is not None
    ema.copy_to(parameters)
    return controlnet.eval().requires_grad_(False), summary


def train_lora(components: DiffusionComponents, style: str, settings: TrainingSettings,
               log: Callable[[str], None]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A style LoRA (``STYLE_WORLDS``) on a copy of the frozen UNet, short captions, ``LORA_TARGETS`` adapted;
    returns its state dict with PEFT key names (UNet keys), as diffusers' LoRA loaders read them."""
    unet: UNet2DConditionModel = copy.deepcopy(components.denoiser)
    unet.requires_grad_(False)
    config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_rank, init_lora_weights="gaussian",
                        target_modules=list(LORA_TARGETS))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed * 10 + 4)
        unet.add_adapter(config)
    unet.train()
    stage = settings.lora
    stream = settings.seed * 10 + 5 + list(STYLE_WORLDS).index(style)
    batches = iter(LatentPool(components.vae, STYLE_WORLDS[style], stream, settings.pool_size // 4,
                              stage.batch_size))
    rng = np.random.default_rng((settings.seed, stream))
    encode = TextEncoding(components)
    denoising = _DenoisingLoss(components, settings, seed=stream)

    def loss_at(_: int) -> torch.Tensor:
        latents, samples = next(batches)
        with torch.no_grad():
            states = encode(choose_captions(samples, rng, dropout=settings.caption_dropout, short_fraction=1.0))
        return denoising(latents, lambda noisy, t: unet(noisy, t, states).sample)

    parameters = [p for p in unet.parameters() if p.requires_grad]
    summary, _ = _optimise(f"lora:{style}", stage, parameters, loss_at, log)
    # PEFT key names (``lora_A`` / ``lora_B``), as diffusers' loaders read them; diffusers'
    # ``convert_state_dict_to_diffusers`` would rename the attention keys only and leave a mixed file.
    state = {key: value.detach().clone().contiguous() for key, value in get_peft_model_state_dict(unet).items()}
    return state, {**summary, "parameters": sum(p.numel() for p in parameters)}


def save_lora(state: dict[str, torch.Tensor], rank: int, path: Path) -> None:
    """diffusers' LoRA file (``unet.`` keys, adapter metadata with rank and alpha), fp16."""
    half = {key: value.to(torch.float16) for key, value in state.items()}
    metadata = {"r": rank, "lora_alpha": rank, "target_modules": list(LORA_TARGETS)}
    StableDiffusionPipeline.save_lora_weights(
        path.parent, unet_lora_layers=half, weight_name=path.name, unet_lora_adapter_metadata=metadata)


def save_components(components: DiffusionComponents, directory: Path) -> None:
    """A diffusers pipeline directory (``model_index.json`` + one folder per part), weights in fp16."""
    half = copy.deepcopy(components.as_pipeline()).to(torch.float16)
    half.save_pretrained(directory, safe_serialization=True)


def _scaled(settings: TrainingSettings, scale: float) -> TrainingSettings:
    """Every stage's steps (and warm-up) times ``scale``: a quick smoke run of the whole recipe."""
    def shrink(stage: StageSettings) -> StageSettings:
        return dataclasses.replace(stage, steps=max(2, round(stage.steps * scale)),
                                   warmup_steps=max(1, round(stage.warmup_steps * scale)))
    return dataclasses.replace(settings, pool_size=max(256, round(settings.pool_size * scale)),
                               vae=shrink(settings.vae), text_to_image=shrink(settings.text_to_image),
                               controlnet=shrink(settings.controlnet), lora=shrink(settings.lora))


TRAINING_STAGES: tuple[str, ...] = ("vae", "text_to_image", "controlnet", "lora")
STAGES: tuple[str, ...] = (*TRAINING_STAGES, "ship", "evaluate")


def run_stage(stage: str, settings: TrainingSettings, work: Path, out: Path, log: Callable[[str], None],
              styles: Sequence[str] = tuple(STYLE_WORLDS)) -> None:
    """One stage; its inputs and outputs live in ``work`` (fp32); ``ship`` writes ``out`` (fp16). The ``lora``
    stage trains ``styles`` (independent: they may run as separate processes)."""
    report: dict[str, Any] = {}
    if stage == "vae":
        components = build_preset("tiny", seed=settings.seed, weights="seeded")
        report = train_vae(components.vae, settings, log)
        components.as_pipeline().save_pretrained(work / "vae", safe_serialization=True)
    elif stage == "text_to_image":
        components = load_local(work / "vae")
        report = train_text_to_image(components, settings, log)
        components.as_pipeline().save_pretrained(work / "text_to_image", safe_serialization=True)
    elif stage == "controlnet":
        controlnet, report = train_controlnet(load_local(work / "text_to_image"), settings, log)
        controlnet.save_pretrained(work / "controlnet", safe_serialization=True)
    elif stage == "lora":
        components = load_local(work / "text_to_image")
        for style in styles:
            state, style_report = train_lora(components, style, settings, log)
            save_lora(state, settings.lora_rank, work / "loras" / f"{style}.safetensors")
            (work / f"report_lora_{style}.json").write_text(json.dumps(style_report, indent=1) + "\n")
        return
    elif stage == "ship":
        save_components(load_local(work / "text_to_image"), out)
        load_controlnet(work / "controlnet").to(torch.float16).save_pretrained(out / "controlnet",
                                                                              safe_serialization=True)
        (out / "loras").mkdir(parents=True, exist_ok=True)
        for style in STYLE_WORLDS:
            shutil.copyfile(work / "loras" / f"{style}.safetensors", out / "loras" / f"{style}.safetensors")
        reports = {name: json.loads((work / f"report_{name}.json").read_text()) for name in TRAINING_STAGES[:-1]}
        reports["lora"] = {style: json.loads((work / f"report_lora_{style}.json").read_text())
                           for style in STYLE_WORLDS}
        record = {"settings": dataclasses.asdict(settings), "stages": reports,
                  "machine": {"platform": platform.platform(), "torch": torch.__version__,
                              "threads": torch.get_num_threads()}}
        (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        return
    elif stage == "evaluate":
        report = evaluate_pipelines(out, n=60, log=log)
        (out / "evaluation.json").write_text(json.dumps(report, indent=1) + "\n")
        return
    else:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    report["threads"] = torch.get_num_threads()
    (work / f"report_{stage}.json").write_text(json.dumps(report, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the tiny diffusion preset on the shapes world (CPU).")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated, in order, from: {', '.join(STAGES)} (default: all)")
    parser.add_argument("--work", type=Path, default=Path("out/train_tiny_diffusion"),
                        help="intermediate weights and per-stage reports (fp32)")
    parser.add_argument("--out", type=Path, default=WEIGHTS_ROOT / "tiny", help="where `ship` writes (fp16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (smoke runs)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--styles", default=",".join(STYLE_WORLDS),
                        help=f"LoRA styles the `lora` stage trains (default: {', '.join(STYLE_WORLDS)})")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    styles = [style.strip() for style in args.styles.split(",") if style.strip()]
    if unknown := set(styles) - set(STYLE_WORLDS):
        parser.error(f"unknown --styles {sorted(unknown)}; styles: {', '.join(STYLE_WORLDS)}")
    settings = TrainingSettings(seed=args.seed)
    if args.scale != 1.0:
        settings = _scaled(settings, args.scale)
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    for stage in [name.strip() for name in args.stages.split(",") if name.strip()]:
        started = time.perf_counter()
        run_stage(stage, settings, args.work, args.out, log=lambda line: print(line, flush=True), styles=styles)
        print(f"[{stage}] done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
