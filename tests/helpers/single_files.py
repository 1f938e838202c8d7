"""Single-file checkpoints written from a preset in the original training code's key layout (the inverse of the
conversions diffusers and ``serving.single_file`` apply): CompVis/Stability's for SD 1.x and SDXL (UNet, VAE, CLIP,
OpenCLIP), Black Forest Labs' for Flux's transformer."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel, UNet2DConditionModel
from safetensors.torch import save_file

from serving.presets import DiffusionComponents

#: diffusers' ResNet names -> the original's (``update_unet_resnet_ldm_to_diffusers`` the other way)
_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"), ("conv2", "out_layers.3"),
           ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))
_UNET_LAYERS = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
                "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
                "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}


def write_single_file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))
    return path


def sd_checkpoint(components: DiffusionComponents) -> dict[str, torch.Tensor]:
    """An SD 1.x model as one CompVis checkpoint: ``model.diffusion_model.`` (UNet), ``first_stage_model.`` (VAE),
    ``cond_stage_model.transformer.`` (CLIP)."""
    assert isinstance(components.denoiser, UNet2DConditionModel)
    return (_prefixed("model.diffusion_model.", ldm_unet(components.denoiser))
            | _prefixed("first_stage_model.", ldm_vae(components.vae))
            | _prefixed("cond_stage_model.transformer.", _clip(components.text_encoder)))


def sdxl_checkpoint(components: DiffusionComponents) -> dict[str, torch.Tensor]:
    """An SDXL model as one Stability checkpoint: its UNet and VAE as SD's, the first CLIP encoder under
    ``conditioner.embedders.0.transformer.``, the second in OpenCLIP's layout under
    ``conditioner.embedders.1.model.``."""
    assert isinstance(components.denoiser, UNet2DConditionModel) and components.text_encoder_2 is not None
    return (_prefixed("model.diffusion_model.", ldm_unet(components.denoiser))
            | _prefixed("first_stage_model.", ldm_vae(components.vae))
            | _prefixed("conditioner.embedders.0.transformer.", _clip(components.text_encoder))
            | _prefixed("conditioner.embedders.1.model.", open_clip(components.text_encoder_2)))


def ldm_unet(unet: UNet2DConditionModel) -> dict[str, torch.Tensor]:
    state, config = unet.state_dict(), unet.config
    per_level = config.layers_per_block + 1
    levels = len(config.block_out_channels)
    renames: dict[str, str] = dict(_UNET_LAYERS)  # diffusers prefix -> original prefix
    for level in range(levels):
        for layer in range(config.layers_per_block):
            index = level * per_level + layer + 1
            renames[f"down_blocks.{level}.resnets.{layer}"] = f"input_blocks.{index}.0"
            renames[f"down_blocks.{level}.attentions.{layer}"] = f"input_blocks.{index}.1"
        renames[f"down_blocks.{level}.downsamplers.0.conv"] = f"input_blocks.{(level + 1) * per_level}.0.op"
        has_attention = any(name.startswith(f"up_blocks.{level}.attentions.") for name in state)
        for layer in range(per_level):
            renames[f"up_blocks.{level}.resnets.{layer}"] = f"output_blocks.{level * per_level + layer}.0"
            renames[f"up_blocks.{level}.attentions.{layer}"] = f"output_blocks.{level * per_level + layer}.1"
        upsampler = f"output_blocks.{level * per_level + per_level - 1}.{2 if has_attention else 1}.conv"
        renames[f"up_blocks.{level}.upsamplers.0.conv"] = upsampler
    renames |= {"mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
                "mid_block.resnets.1": "middle_block.2"}
    return {_renamed(name, renames, resnet=".resnets." in name): tensor for name, tensor in state.items()}


def ldm_vae(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    state = vae.state_dict()
    levels = len(vae.config.block_out_channels)
    renames = {"encoder.conv_norm_out": "encoder.norm_out", "decoder.conv_norm_out": "decoder.norm_out"}
    for side in ("encoder", "decoder"):
        renames |= {f"{side}.mid_block.resnets.0": f"{side}.mid.block_1",
                    f"{side}.mid_block.resnets.1": f"{side}.mid.block_2",
                    f"{side}.mid_block.attentions.0": f"{side}.mid.attn_1"}
    for level in range(levels):
        renames[f"encoder.down_blocks.{level}.resnets"] = f"encoder.down.{level}.block"
        renames[f"encoder.down_blocks.{level}.downsamplers.0"] = f"encoder.down.{level}.downsample"
        renames[f"decoder.up_blocks.{level}.resnets"] = f"decoder.up.{levels - 1 - level}.block"
        renames[f"decoder.up_blocks.{level}.upsamplers.0"] = f"decoder.up.{levels - 1 - level}.upsample"
    attention = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    converted = {}
    for name, tensor in state.items():
        new = _renamed(name, renames).replace("conv_shortcut", "nin_shortcut")
        if ".mid.attn_1." in new:
            module, _, suffix = new.rpartition(".")
            head, _, leaf = module.rpartition(".attn_1.")
            new = f"{head}.attn_1.{attention.get(leaf, leaf)}.{suffix}"
            if suffix == "weight" and tensor.dim() == 2:  # the original's attention projections are 1x1 convolutions
                tensor = tensor[:, :, None, None]
        converted[new] = tensor
    return converted


def open_clip(encoder) -> dict[str, torch.Tensor]:
    """A ``CLIPTextModelWithProjection`` in OpenCLIP's layout: fused ``in_proj`` attention, the projection
    transposed."""
    state = encoder.state_dict()
    converted = {"positional_embedding": state["text_model.embeddings.position_embedding.weight"],
                 "token_embedding.weight": state["text_model.embeddings.token_embedding.weight"],
                 "ln_final.weight": state["text_model.final_layer_norm.weight"],
                 "ln_final.bias": state["text_model.final_layer_norm.bias"],
                 "text_projection": state["text_projection.weight"].T}
    for layer in range(encoder.config.num_hidden_layers):
        source, target = f"text_model.encoder.layers.{layer}.", f"transformer.resblocks.{layer}."
        for suffix in ("weight", "bias"):
            converted[f"{target}attn.in_proj_{suffix}"] = torch.cat(
                [state[f"{source}self_attn.{name}_proj.{suffix}"] for name in ("q", "k", "v")])
            for diffusers_name, original in (("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                                             ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"),
                                             ("mlp.fc2", "mlp.c_proj")):
                converted[f"{target}{original}.{suffix}"] = state[f"{source}{diffusers_name}.{suffix}"]
    return converted


def flux_checkpoint(transformer: FluxTransformer2DModel, prefix: str = "") -> dict[str, torch.Tensor]:
    """A Flux transformer in Black Forest Labs' layout (``prefix``: ComfyUI's ``model.diffusion_model.``)."""
    state, config = transformer.state_dict(), transformer.config
    out: dict[str, torch.Tensor] = {}

    def put(original: str, name: str) -> None:
        for suffix in ("weight", "bias"):
            out[f"{original}.{suffix}"] = state[f"{name}.{suffix}"]

    def fuse(original: str, names: list[str]) -> None:
        for suffix in ("weight", "bias"):
            out[f"{original}.{suffix}"] = torch.cat([state[f"{name}.{suffix}"] for name in names])

    embedders = {"time_in": "time_text_embed.timestep_embedder", "vector_in": "time_text_embed.text_embedder"}
    if config.guidance_embeds:
        embedders["guidance_in"] = "time_text_embed.guidance_embedder"
    for original, name in embedders.items():
        put(f"{original}.in_layer", f"{name}.linear_1")
        put(f"{original}.out_layer", f"{name}.linear_2")
    put("txt_in", "context_embedder")
    put("img_in", "x_embedder")
    for i in range(config.num_layers):
        block, original = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for stream, prefix_name, norm, ff, qkv in (
                ("img", "", "norm1", "ff", ["to_q", "to_k", "to_v"]),
                ("txt", "added_", "norm1_context", "ff_context", ["add_q_proj", "add_k_proj", "add_v_proj"])):
            put(f"{original}.{stream}_mod.lin", f"{block}.{norm}.linear")
            fuse(f"{original}.{stream}_attn.qkv", [f"{block}.attn.{name}" for name in qkv])
            put(f"{original}.{stream}_mlp.0", f"{block}.{ff}.net.0.proj")
            put(f"{original}.{stream}_mlp.2", f"{block}.{ff}.net.2")
            out[f"{original}.{stream}_attn.norm.query_norm.scale"] = state[f"{block}.attn.norm_{prefix_name}q.weight"]
            out[f"{original}.{stream}_attn.norm.key_norm.scale"] = state[f"{block}.attn.norm_{prefix_name}k.weight"]
        put(f"{original}.img_attn.proj", f"{block}.attn.to_out.0")
        put(f"{original}.txt_attn.proj", f"{block}.attn.to_add_out")
    for i in range(config.num_single_layers):
        block, original = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        put(f"{original}.modulation.lin", f"{block}.norm.linear")
        fuse(f"{original}.linear1", [f"{block}.attn.to_q", f"{block}.attn.to_k", f"{block}.attn.to_v",
                                     f"{block}.proj_mlp"])
        put(f"{original}.linear2", f"{block}.proj_out")
        out[f"{original}.norm.query_norm.scale"] = state[f"{block}.attn.norm_q.weight"]
        out[f"{original}.norm.key_norm.scale"] = state[f"{block}.attn.norm_k.weight"]
    put("final_layer.linear", "proj_out")
    for suffix in ("weight", "bias"):
        scale, shift = state[f"norm_out.linear.{suffix}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{suffix}"] = torch.cat([shift, scale])
    return _prefixed(prefix, out)


def _clip(encoder) -> dict[str, torch.Tensor]:
    """A CLIP text encoder's tensors as the original checkpoints name them (``text_model.`` first)."""
    return {name if name.startswith(("text_model.", "text_projection")) else f"text_model.{name}": tensor
            for name, tensor in encoder.state_dict().items()}


def _renamed(name: str, renames: dict[str, str], *, resnet: bool = False) -> str:
    """``name`` with the longest matching diffusers prefix replaced by the original's (a ResNet's layers
    renamed too)."""
    for prefix in sorted(renames, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):]
            if resnet:
                for diffusers_name, original in _RESNET:
                    rest = rest.replace(f".{diffusers_name}.", f".{original}.")
            return renames[prefix] + rest
    return name


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + name: tensor for name, tensor in tensors.items()}
