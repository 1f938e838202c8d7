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
    key = next(k for k in a if k.startswith("unet.") and k.endswith("weight") and a[k].dim() > 1)
    assert not torch.equal(a[key], b[key])


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny"):
        build_preset("sdxl-please")


def test_tiny_geometry():
    tiny = build_preset("tiny")
    assert (tiny.default_size, tiny.size_multiple) == (64, 8)
    assert tiny.text_encoder.config.vocab_size == len(tiny.tokenizer)
    assert tiny.unet.config.cross_attention_dim == tiny.text_encoder.config.hidden_size
    assert not any(p.requires_grad for module in tiny.modules().values() for p in module.parameters())


@pytest.mark.slow
def test_sd15_shape_has_stable_diffusion_15_architecture():
    sd15 = build_preset("sd15-shape")
    unet_params = sum(p.numel() for p in sd15.unet.parameters())
    assert 850e6 < unet_params < 870e6  # SD 1.5's UNet has 859.5M parameters
    assert (sd15.default_size, sd15.size_multiple) == (512, 8)
    assert sd15.text_encoder.config.hidden_size == sd15.unet.config.cross_attention_dim == 768
    assert "sd15-shape" in PRESET_NAMES


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
    assert not torch.equal(trained["unet.conv_in.weight"], build_preset("tiny").unet.conv_in.weight)
    with pytest.raises(ValueError, match="weights must be one of auto, seeded"):
        build_preset("tiny", weights="trained")
