"""Single-file checkpoints: one ``.safetensors`` in the layout of the model's original training code, as most
checkpoints are downloaded. SD 1.x/2.x and SDXL files (UNet, VAE and text encoders in one file) load through
diffusers' ``from_single_file`` with local files only; a Flux file (its transformer, in Black Forest Labs' layout,
bare or under ``model.diffusion_model.``) is converted here, because diffusers' converter assumes Flux.1's full
width (3072) and reads no other.

``config`` supplies what the file does not: a family preset's name (its configs and tokenizers; a component the
file lacks keeps the preset's seeded weights) or a local diffusers directory of the file's family (configs,
tokenizers, and the components the file lacks: a Flux file holds only the transformer). The file's family is read
from its tensor names before any tensor loads, and one of another family than ``config``'s is refused naming both.
Only ``.safetensors`` is opened: a pickled ``.ckpt`` can run code when it loads.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from safetensors import safe_open
from safetensors.torch import load_file

from serving.preset_catalog import PRESET_FAMILIES
from serving.presets import (
    DiffusionComponents,
    ModelFamily,
    build_preset,
    components_of,
    load_local,
    local_family,
    pipeline_loader,
)

#: A tensor name only each layout has (after a ``model.diffusion_model.`` prefix, where the file has one).
_MARKERS: tuple[tuple[str, str], ...] = (
    ("double_blocks.0.img_attn.qkv.weight", "flux"),
    ("joint_blocks.0.context_block.attn.qkv.weight", "sd3"),
    ("label_emb.0.0.weight", "sdxl"),  # the UNet's added embedding (pooled text and size ids)
    ("input_blocks.0.0.weight", "sd"),
)
_UNET_PREFIX = "model.diffusion_model."
_SERVED: tuple[ModelFamily, ...] = ("sd", "sdxl", "flux")


class SingleFileError(ValueError):
    """A single-file checkpoint that cannot be served with its ``config``; the message names the file."""


def checkpoint_family(path: Path) -> str:
    """The family whose original layout ``path``'s tensor names follow (only the header is read), or
    ``SingleFileError``."""
    names = _tensor_names(path)
    bare = {name.removeprefix(_UNET_PREFIX) for name in names}
    for marker, family in _MARKERS:
        if marker in bare:
            return family
    raise SingleFileError(f"{path}: no UNet or transformer of a known layout (SD 1.x/2.x, SDXL, Flux) in its "
                          f"{len(names)} tensors")


def load_single_file(path: str | Path, config: str | Path) -> DiffusionComponents:
    """The model in single file ``path``, with what it lacks from ``config`` (a preset name or a local diffusers
    directory); ``SingleFileError`` for a file that is not ``.safetensors``, not a known layout, of a family not
    served as a single file, or of another family than ``config``'s."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise SingleFileError(f"{path}: only .safetensors single files are loaded (a pickled .ckpt can run code when "
                              "it loads); convert it to safetensors first")
    if not path.is_file():
        raise SingleFileError(f"{path}: no such file")
    found = checkpoint_family(path)
    if found not in _SERVED:
        raise SingleFileError(f"{path}: a {found} checkpoint; single files are served for {', '.join(_SERVED)} "
                              "(load an sd3 model from a diffusers directory)")
    expected = _config_family(config)
    if found != expected:
        raise SingleFileError(f"{path} holds a {found} model, and config {str(config)!r} is a {expected} model")
    if found == "flux":
        return _load_flux(path, config)
    pipeline_cls, without = pipeline_loader(found)
    with _config_directory(config) as directory:
        pipe = pipeline_cls.from_single_file(str(path), config=str(directory), local_files_only=True,
                                             torch_dtype=torch.float32, **without)
    return components_of(pipe, found)


def _load_flux(path: Path, config: str | Path) -> DiffusionComponents:
    """The transformer from ``path`` (built without weights of its own, then given the file's), everything else from
    ``config``."""
    components = build_preset(str(config), weights="seeded") if str(config) in PRESET_FAMILIES else load_local(config)
    with torch.device("meta"):
        transformer = FluxTransformer2DModel.from_config(components.denoiser.config)
    try:
        state = flux_transformer_state_dict(load_file(str(path)), transformer)
        transformer.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=True,
                                    assign=True)
    except (KeyError, RuntimeError) as exc:  # a tensor missing, left over or of another shape
        raise SingleFileError(f"{path}: its Flux transformer does not fit config {str(config)!r}: {exc}") from None
    components.denoiser = transformer.eval().requires_grad_(False)
    return components


def flux_transformer_state_dict(checkpoint: dict[str, torch.Tensor],
                                transformer: FluxTransformer2DModel) -> dict[str, torch.Tensor]:
    """A Flux transformer in Black Forest Labs' layout (fused qkv, a single block's qkv and MLP input in one
    ``linear1``, the final modulation as shift then scale) as ``transformer``'s state dict, its widths from
    ``transformer``'s config."""
    source = {name.removeprefix(_UNET_PREFIX): tensor for name, tensor in checkpoint.items()}
    config = transformer.config
    width = config.num_attention_heads * config.attention_head_dim
    state: dict[str, torch.Tensor] = {}

    def take(target: str, name: str) -> None:
        for suffix in ("weight", "bias"):
            state[f"{target}.{suffix}"] = source.pop(f"{name}.{suffix}")

    def split(targets: list[str], name: str, sizes: list[int]) -> None:
        for suffix in ("weight", "bias"):
            for target, part in zip(targets, torch.split(source.pop(f"{name}.{suffix}"), sizes), strict=True):
                state[f"{target}.{suffix}"] = part.contiguous()

    embedders = {"time_text_embed.timestep_embedder": "time_in", "time_text_embed.text_embedder": "vector_in"}
    if config.guidance_embeds:
        embedders["time_text_embed.guidance_embedder"] = "guidance_in"
    for target, name in embedders.items():
        take(f"{target}.linear_1", f"{name}.in_layer")
        take(f"{target}.linear_2", f"{name}.out_layer")
    take("context_embedder", "txt_in")
    take("x_embedder", "img_in")
    for i in range(config.num_layers):
        block, original = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for stream, prefix, norm in (("img", "", "norm1"), ("txt", "added_", "norm1_context")):
            take(f"{block}.{norm}.linear", f"{original}.{stream}_mod.lin")
            names = ["to_q", "to_k", "to_v"] if stream == "img" else ["add_q_proj", "add_k_proj", "add_v_proj"]
            split([f"{block}.attn.{name}" for name in names], f"{original}.{stream}_attn.qkv", [width] * 3)
            ff = "ff" if stream == "img" else "ff_context"
            take(f"{block}.{ff}.net.0.proj", f"{original}.{stream}_mlp.0")
            take(f"{block}.{ff}.net.2", f"{original}.{stream}_mlp.2")
            state[f"{block}.attn.norm_{prefix}q.weight"] = source.pop(f"{original}.{stream}_attn.norm.query_norm.scale")
            state[f"{block}.attn.norm_{prefix}k.weight"] = source.pop(f"{original}.{stream}_attn.norm.key_norm.scale")
        take(f"{block}.attn.to_out.0", f"{original}.img_attn.proj")
        take(f"{block}.attn.to_add_out", f"{original}.txt_attn.proj")
    mlp = transformer.single_transformer_blocks[0].proj_mlp.out_features if config.num_single_layers else 0
    for i in range(config.num_single_layers):
        block, original = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        take(f"{block}.norm.linear", f"{original}.modulation.lin")
        split([f"{block}.attn.to_q", f"{block}.attn.to_k", f"{block}.attn.to_v", f"{block}.proj_mlp"],
              f"{original}.linear1", [width, width, width, mlp])
        take(f"{block}.proj_out", f"{original}.linear2")
        state[f"{block}.attn.norm_q.weight"] = source.pop(f"{original}.norm.query_norm.scale")
        state[f"{block}.attn.norm_k.weight"] = source.pop(f"{original}.norm.key_norm.scale")
    take("proj_out", "final_layer.linear")
    for suffix in ("weight", "bias"):
        shift, scale = source.pop(f"final_layer.adaLN_modulation.1.{suffix}").chunk(2)
        state[f"norm_out.linear.{suffix}"] = torch.cat([scale, shift])
    if source:
        raise SingleFileError(f"tensors this Flux transformer has no place for: {sorted(source)[:5]}")
    return state


def _config_family(config: str | Path) -> str:
    if str(config) in PRESET_FAMILIES:
        return PRESET_FAMILIES[str(config)]
    try:
        return local_family(config)
    except ValueError as exc:
        raise SingleFileError(f"config: {exc}") from None


@contextmanager
def _config_directory(config: str | Path) -> Iterator[Path]:
    """``config`` as a local diffusers directory: itself, or a preset written to a temporary one for the load."""
    if str(config) not in PRESET_FAMILIES:
        yield Path(config)
        return
    with tempfile.TemporaryDirectory(prefix="swiftserve-config-") as directory:
        build_preset(str(config), weights="seeded").as_pipeline().save_pretrained(directory)
        yield Path(directory)


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own errors on a malformed header
        raise SingleFileError(f"{path}: not a safetensors file ({exc})") from None
