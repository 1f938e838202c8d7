import json

import pytest
import torch

from serving.preset_catalog import PRESET_NAMES, preset_weights
from serving.presets import build_preset, load_local


def _state(components) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name, module in components.modules().items()
            for key, value in module.state_dict().items()}


def test_tiny_preset_is_bit_identical_across_builds():
    first, second = _state(build_preset("tiny")), _state(build_preset("tiny"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_seed_changes_weights_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b = _state(build_preset("tiny", seed=0)), _state(build_preset("tiny", seed=1))
    assert torch.equal(torch.rand(1), expected_next)
    key = next(k for k in a if k.startswith("denoiser.") and k.endswith("weight") and a[k].dim() > 1)
    assert not torch.equal(a[key], b[key])


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny"):
        build_preset("sdxl-please")


def test_tiny_geometry():
    tiny = build_preset("tiny")
    assert (tiny.default_size, tiny.size_multiple) == (64, 8)
    assert tiny.text_encoder.config.vocab_size == len(tiny.tokenizer)
    assert tiny.denoiser.config.cross_attention_dim == tiny.text_encoder.config.hidden_size
    assert not any(p.requires_grad for module in tiny.modules().values() for p in module.parameters())


def test_sd15_shape_has_stable_diffusion_15_architecture():
    with torch.device("meta"):  # its architecture, not its 4 GB of random weights
        sd15 = build_preset("sd15-shape")
    unet_params = sum(p.numel() for p in sd15.denoiser.parameters())
    assert 850e6 < unet_params < 870e6  # SD 1.5's UNet has 859.5M parameters
    assert (sd15.default_size, sd15.size_multiple) == (512, 8)
    assert sd15.text_encoder.config.hidden_size == sd15.denoiser.config.cross_attention_dim == 768
    assert "sd15-shape" in PRESET_NAMES


def test_sdxl_tiny_has_two_text_encoders_feeding_the_unets_cross_attention_and_added_embedding():
    sdxl = build_preset("sdxl-tiny")
    assert sdxl.family == "sdxl" and build_preset("tiny").family == "sd"
    assert (sdxl.default_size, sdxl.size_multiple) == (64, 8)
    hidden = sdxl.text_encoder.config.hidden_size + sdxl.text_encoder_2.config.hidden_size
    assert sdxl.denoiser.config.cross_attention_dim == hidden
    added = 6 * sdxl.denoiser.config.addition_time_embed_dim + sdxl.text_encoder_2.config.projection_dim
    assert sdxl.denoiser.config.projection_class_embeddings_input_dim == added
    assert set(sdxl.modules()) == {"denoiser", "vae", "text_encoder", "text_encoder_2"}


def test_sd3_tiny_has_the_sd3_architecture_with_consistent_widths():
    sd3 = build_preset("sd3-tiny")
    transformer = sd3.denoiser.config
    assert sd3.family == "sd3" and set(sd3.modules()) == {"denoiser", "vae", "text_encoder", "text_encoder_2",
                                                          "text_encoder_3"}
    # 64 px at 4 px per latent and 2 latents per patch; sides multiples of 8, at most 32 patches
    assert (sd3.default_size, sd3.latent_factor, sd3.size_multiple, sd3.max_side) == (64, 8, 8, 256)
    assert transformer.in_channels == sd3.vae.config.latent_channels == 16
    assert transformer.joint_attention_dim == sd3.text_encoder_3.config.d_model  # CLIP states are padded to T5's
    clip = sd3.text_encoder.config.hidden_size + sd3.text_encoder_2.config.hidden_size
    assert clip <= transformer.joint_attention_dim  # padded, not cut
    pooled = sd3.text_encoder.config.projection_dim + sd3.text_encoder_2.config.projection_dim
    assert transformer.pooled_projection_dim == pooled
    assert sd3.text_encoder_3.config.vocab_size == len(sd3.tokenizer_3)
    assert sd3.vae.config.shift_factor and not sd3.vae.config.use_quant_conv  # SD3's VAE
    assert type(sd3.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"


def test_an_sd3_component_set_needs_its_t5_encoder_and_only_sd3_and_flux_take_one():
    sd3, tiny = build_preset("sd3-tiny"), build_preset("tiny")
    with pytest.raises(ValueError, match="text_encoder_3"):
        type(sd3)(sd3.denoiser, sd3.vae, sd3.text_encoder, sd3.tokenizer, sd3.scheduler,
                  text_encoder_2=sd3.text_encoder_2, tokenizer_2=sd3.tokenizer_2)
    with pytest.raises(ValueError, match="only an SD3 or Flux transformer"):
        type(tiny)(tiny.denoiser, tiny.vae, tiny.text_encoder, tiny.tokenizer, tiny.scheduler,
                   text_encoder_3=sd3.text_encoder_3, tokenizer_3=sd3.tokenizer_3)


def test_a_local_sd3_directory_loads_as_sd3(tmp_path):
    sd3 = build_preset("sd3-tiny", seed=7)
    sd3.as_pipeline().save_pretrained(tmp_path)
    loaded = load_local(tmp_path)
    assert loaded.family == "sd3"
    assert loaded.tokenizer_3("a red circle").input_ids == sd3.tokenizer_3("a red circle").input_ids
    original, reloaded = _state(sd3), _state(loaded)
    assert original.keys() == reloaded.keys()
    assert all(torch.equal(original[key], reloaded[key]) for key in original)


def test_sdxl_shape_has_the_sdxl_base_architecture_sized_without_its_memory():
    with torch.device("meta"):
        sdxl = build_preset("sdxl-shape")
    parameters = {name: sum(p.numel() for p in module.parameters()) for name, module in sdxl.modules().items()}
    assert parameters["denoiser"] == 2_567_463_684  # SDXL 1.0 base's UNet
    assert parameters["vae"] == 83_653_863  # and its VAE
    assert (sdxl.default_size, sdxl.denoiser.config.cross_attention_dim) == (1024, 768 + 1280)


def test_an_sdxl_component_set_needs_both_second_parts():
    sdxl = build_preset("sdxl-tiny")
    with pytest.raises(ValueError, match="text_encoder_2"):
        type(sdxl)(sdxl.denoiser, sdxl.vae, sdxl.text_encoder, sdxl.tokenizer, sdxl.scheduler)
    tiny = build_preset("tiny")
    with pytest.raises(ValueError, match="text_encoder_2"):
        type(tiny)(tiny.denoiser, tiny.vae, tiny.text_encoder, tiny.tokenizer, tiny.scheduler,
                   text_encoder_2=sdxl.text_encoder_2, tokenizer_2=sdxl.tokenizer_2)


def test_a_local_sdxl_directory_loads_as_sdxl(tmp_path):
    sdxl = build_preset("sdxl-tiny", seed=7)
    sdxl.force_zeros_for_empty_prompt = False
    sdxl.as_pipeline().save_pretrained(tmp_path)
    loaded = load_local(tmp_path)
    assert loaded.family == "sdxl" and loaded.force_zeros_for_empty_prompt is False
    original, reloaded = _state(sdxl), _state(loaded)
    assert original.keys() == reloaded.keys()
    assert all(torch.equal(original[key], reloaded[key]) for key in original)
    assert type(loaded.scheduler) is type(sdxl.scheduler)


def test_a_local_directory_of_a_pipeline_not_served_is_refused_naming_the_served_ones(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "PixArtAlphaPipeline"}))
    with pytest.raises(ValueError, match="'PixArtAlphaPipeline' is not served; served: StableDiffusionPipeline, "
                                         "StableDiffusionXLPipeline, StableDiffusion3Pipeline, FluxPipeline"):
        load_local(tmp_path)


def test_local_directory_loads_without_hub(tmp_path):
    tiny = build_preset("tiny", seed=7)
    tiny.as_pipeline().save_pretrained(tmp_path)
    loaded = load_local(tmp_path)
    original, reloaded = _state(tiny), _state(loaded)
    assert original.keys() == reloaded.keys()
    assert all(torch.equal(original[key], reloaded[key]) for key in original)
    assert loaded.tokenizer("a red circle").input_ids == tiny.tokenizer("a red circle").input_ids


def test_local_directory_must_be_a_diffusers_model(tmp_path):
    with pytest.raises(ValueError, match=r"model_index\.json"):
        load_local(tmp_path)


def test_weights_choice_auto_loads_shipped_weights_and_falls_back_to_the_seed():
    assert preset_weights("tiny") is not None and preset_weights("sd15-shape") is None
    trained = _state(build_preset("tiny", weights="auto"))
    assert trained.keys() == _state(build_preset("tiny")).keys()
    assert not torch.equal(trained["denoiser.conv_in.weight"], build_preset("tiny").denoiser.conv_in.weight)
    with pytest.raises(ValueError, match="weights must be one of auto, seeded"):
        build_preset("tiny", weights="trained")
