"""SD3-specific paths (``sd3-tiny``: an MMDiT transformer denoiser): sizes its patches and positional grid refuse,
ControlNets as a service against diffusers' StableDiffusion3ControlNetPipeline, per-row LoRAs on the transformer.
Equality with StableDiffusion3Pipeline (plain, LoRAs, batching, parallel CFG, the images API): test_families.py."""

import numpy as np
import pytest
import torch

from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.diffusion_engine import InvalidImageSize
from serving.presets import build_preset
from tests.helpers.denoising import denoise_together, loaded_lora
from tests.helpers.lora_files import write_lora
from tests.helpers.transformer_controlnets import control_specs, local_services, reference_images, seeded_controlnets

CPU = torch.device("cpu")
TOLERANCE = 1e-3  # max abs pixel difference on a 0..1 scale


def _engine(**kwargs) -> DiffusionEngine:
    return DiffusionEngine("sd3-tiny", build_preset("sd3-tiny"), CPU, **kwargs)


def _params(**overrides) -> GenerationParams:
    values = dict(prompt="a red circle on a white background", width=64, height=64, num_inference_steps=2,
                  guidance_scale=5.0, seed=3)
    return GenerationParams(**{**values, **overrides})


@pytest.mark.parametrize(("width", "height", "message"), [
    (60, 64, "multiples of 8"),  # 4 (VAE) x 2 (patch): a side the transformer's patches cannot tile
    (264, 64, "at most 256"),  # past the positional embedding's 32 x 32 grid
])
def test_sizes_the_sd3_transformer_cannot_take_are_refused(width, height, message):
    with pytest.raises(InvalidImageSize, match=message) as raised:
        _engine().start(_params(width=width, height=height))
    assert raised.value.status_code == 400


@pytest.mark.parametrize("instantx", [True, False], ids=["instantx", "shifted"])
@pytest.mark.parametrize("names", [("edges",), ("edges", "mask")], ids=["one", "two"])
def test_sd3_controlnets_match_diffusers_sd3_controlnet_pipeline(names, instantx, monkeypatch):
    """ControlNets as a service on the transformer's blocks; two sum like SD3MultiControlNetModel. InstantX-style
    ControlNets (``force_zeros_for_pooled_projection``) take zero pooled projections and unshifted latents."""
    controlnets = seeded_controlnets(
        "sd3-tiny", lambda model: model.register_to_config(force_zeros_for_pooled_projection=instantx))
    params = _params(controlnets=control_specs(names), n=2)
    ours = denoise_together(_engine(controlnets=local_services(controlnets)), [(params, [])])[0]
    assert np.abs(ours - reference_images("sd3-tiny", controlnets, params, monkeypatch)).max() <= TOLERANCE
    plain = denoise_together(_engine(), [(_params(n=2), [])])[0]
    assert np.abs(ours - plain).max() > 20 * TOLERANCE


def test_an_sd3_lora_and_a_plain_request_share_a_forward_each_as_alone(tmp_path):
    """Per-row LoRAs on the transformer: a request with a LoRA and one without, stepped together."""
    engine = _engine()
    lora = loaded_lora(engine, write_lora(tmp_path / "style.safetensors", seed=6, preset="sd3-tiny"), 1.0)
    requests = [(_params(seed=1), [lora]), (_params(seed=2, n=2), [])]
    together = denoise_together(engine, requests)
    for (params, loras), image in zip(requests, together, strict=True):
        np.testing.assert_allclose(image, denoise_together(engine, [(params, loras)])[0], atol=1e-5)
    assert np.abs(together[0] - denoise_together(engine, [(_params(seed=1), [])])[0]).max() > 20 * TOLERANCE
