"""The benchmark's second and third model over one copy of the weights (``sharing_weights``), a ControlNet's encoder
over its UNet's (``share_encoder_with_unet``), and diffusers' fused LoRA undone before anything else runs on them
(``bench_diffusion.Diffusers``)."""

import numpy as np
import pytest
import torch

from benchmarks.bench_diffusion import WARM, Diffusers, LoRAFiles
from benchmarks.common import share_encoder_with_unet, sharing_weights, write_attention_lora
from serving.controlnet.models import build_controlnet_preset
from serving.engine import GenerationParams
from serving.lora.format import LoRATargets
from serving.presets import build_preset


def _weights(components) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name, module in components.modules().items()
            for key, value in module.state_dict().items()}


@pytest.fixture(scope="module")
def model():
    return build_preset("sdxl-tiny")


def test_the_copy_holds_the_same_storage_in_modules_of_its_own(model):
    twin = sharing_weights(model)
    original, copied = _weights(model), _weights(twin)
    assert original.keys() == copied.keys()
    assert all(copied[key].data_ptr() == original[key].data_ptr() for key in original)
    for name, module in model.modules().items():
        assert twin.modules()[name] is not module
        assert not {id(p) for p in module.parameters()} & {id(p) for p in twin.modules()[name].parameters()}
    assert twin.scheduler is not model.scheduler and twin.tokenizer is model.tokenizer


def test_the_copy_computes_what_the_original_computes(model):
    twin = sharing_weights(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.tokenizer.vocab_size, (1, 8), generator=generator)
    with torch.no_grad():
        assert torch.equal(twin.text_encoder(ids).last_hidden_state, model.text_encoder(ids).last_hidden_state)
        latents = torch.randn(1, 4, 8, 8, generator=generator)
        assert torch.equal(twin.vae.decode(latents).sample, model.vae.decode(latents).sample)


def test_moving_the_copy_to_another_dtype_leaves_the_original(model):
    twin = sharing_weights(model)
    twin.vae.to(torch.float64)
    assert {p.dtype for p in twin.vae.parameters()} == {torch.float64}
    assert {p.dtype for p in model.vae.parameters()} == {torch.float32}


def test_a_fused_diffusers_lora_is_undone_in_the_shared_weights_after_its_case(model, tmp_path):
    before = {key: value.clone() for key, value in _weights(model).items() if key.startswith("denoiser.")}
    targets = LoRATargets.from_modules(model.denoiser, model.text_encoder, model.text_encoder_2)
    files = LoRAFiles(tmp_path, targets, rank=4, store_bytes_per_s=2**30)
    write_attention_lora(tmp_path / f"{WARM}.safetensors", targets, rank=4, seed=1)
    params = GenerationParams(prompt="a cat", width=64, height=64, num_inference_steps=1, guidance_scale=7.5, seed=0)
    controlnet = build_controlnet_preset("sdxl-tiny")
    vanilla = Diffusers(sharing_weights(model), torch.device("cpu"), torch.float32, controlnet, files, params,
                        np.zeros((64, 64, 3), np.uint8))
    case = vanilla.cases["0c-1l warm (fused)"]
    case.prepare()
    fused = _weights(model)
    changed = [key for key in before if not torch.equal(fused[key], before[key])]
    assert changed and all(key.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight"))
                           for key in changed)  # written in place, into the storage the original reads
    case.finish()
    assert vanilla.state == "none"
    after = _weights(model)
    assert all(torch.allclose(after[key], before[key], atol=1e-6) for key in before)


def _controlnet_residuals(controlnet, model) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        down, mid = controlnet(
            torch.randn(1, 4, 8, 8, generator=generator), 10, torch.randn(1, 4, 80, generator=generator),
            torch.rand(1, 3, 16, 16, generator=generator), return_dict=False,
            added_cond_kwargs={"text_embeds": torch.randn(1, 48, generator=generator),
                               "time_ids": torch.randn(1, 6, generator=generator)})
    return (*down, mid)


def test_a_controlnet_encoder_shares_the_unet_storage_and_computes_the_same(model):
    controlnet = build_controlnet_preset("sdxl-tiny", denoiser=model.denoiser)
    before = _controlnet_residuals(controlnet, model)
    encoder_bytes = sum(p.numel() * p.element_size()
                        for part in (controlnet.conv_in, controlnet.time_embedding, controlnet.add_embedding,
                                     controlnet.down_blocks, controlnet.mid_block) for p in part.parameters())
    assert share_encoder_with_unet(controlnet, model.denoiser) == encoder_bytes
    unet = dict(model.denoiser.named_parameters())
    shared = {name: p for name, p in controlnet.named_parameters() if name.startswith(("down_blocks.", "mid_block."))}
    assert shared and all(p.data_ptr() == unet[name].data_ptr() and p is not unet[name] for name, p in shared.items())
    assert controlnet.controlnet_cond_embedding.conv_out.weight.data_ptr() not in {p.data_ptr() for p in unet.values()}
    after = _controlnet_residuals(controlnet, model)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_controlnet_encoder_that_differs_from_the_unet_is_not_shared(model):
    controlnet = build_controlnet_preset("sdxl-tiny", denoiser=model.denoiser)
    with torch.no_grad():
        controlnet.mid_block.resnets[0].conv1.weight.add_(1.0)
    with pytest.raises(ValueError, match=r"mid_block\.resnets\.0\.conv1\.weight is not a copy"):
        share_encoder_with_unet(controlnet, model.denoiser)
