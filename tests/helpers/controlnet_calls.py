"""Calling a served ControlNet directly, as a base-model replica does, with a call of any size (e.g. one that
holds its replica busy for many seconds)."""

import torch
from diffusers import ControlNetModel
from ray import serve

from serving.controlnet.models import controlnet_preset_weights
from serving.controlnet.runner import ControlNetCall, ControlNetResiduals
from serving.deployments.controlnet import ServeControlNets


def preset_controlnet_call(preset: str, rows: int, latent: int) -> ControlNetCall:
    """A call of ``rows`` rows of ``latent`` x ``latent`` latents (zeros, one text embedding, one conditioning
    image) for the shipped ControlNet of diffusion preset ``preset``, shaped by its config."""
    config = ControlNetModel.load_config(controlnet_preset_weights(preset))
    image = latent * 2 ** (len(config["conditioning_embedding_out_channels"]) - 1)  # its stride-2 convolutions
    context = torch.zeros(1, 8, config["cross_attention_dim"])
    return ControlNetCall(
        sample=torch.zeros(rows, config["in_channels"], latent, latent),
        timestep=torch.full((rows,), 500),
        encoder_hidden_states=context.expand(rows, -1, -1),
        context_rows=[(context, 0)] * rows,
        scales=torch.ones(rows),
        images=[(torch.zeros(1, config["conditioning_channels"], image, image), rows)],
    )


def call_controlnet(app: str, name: str, call: ControlNetCall, timeout_s: float,
                    model: str | None = None) -> ControlNetResiduals:
    """``call`` answered by ``app``'s ControlNet ``name`` (its ``ControlNet_<name>`` deployment, or
    ``ControlNet_<name>_<model>`` in an app of several models) through the engine's own client; waits at most
    ``timeout_s``."""
    deployment = f"ControlNet_{name}" if model is None else f"ControlNet_{name}_{model}"
    handle = serve.get_deployment_handle(deployment, app_name=app)
    return ServeControlNets({name: handle}, timeout_s).submit(name, call).result()
