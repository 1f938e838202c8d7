"""Single-file checkpoints (``serving.single_file``): a preset written in its original training layout loads back
to the preset's images (SD 1.x and SDXL through diffusers' ``from_single_file``, Flux through our converter, with a
preset or a local diffusers directory as ``config``); pickles, unknown layouts, families the config does not have and
families not served as single files are refused before any weight loads, naming the file."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from serving.config import DiffusionModelConfig
from serving.engine import DiffusionEngine, GenerationParams
from serving.engine.diffusion_engine import load_components
from serving.presets import build_preset
from serving.single_file import SingleFileError, checkpoint_family, load_single_file
from tests.helpers.denoising import denoise_together
from tests.helpers.single_files import flux_checkpoint, sd_checkpoint, sdxl_checkpoint, write_single_file

CPU = torch.device("cpu")


def _images(components, preset: str) -> np.ndarray:
    params = GenerationParams(prompt="a red circle on a white background", width=64, height=64,
                              num_inference_steps=2, guidance_scale=3.5 if preset == "flux-tiny" else 5.0, seed=3,
                              true_cfg=preset == "flux-tiny")
    return denoise_together(DiffusionEngine(preset, components, CPU), [(params, [])])[0]


@pytest.fixture(scope="module")
def sd_file(tmp_path_factory):
    return write_single_file(tmp_path_factory.mktemp("sd") / "tiny.safetensors",
                             sd_checkpoint(build_preset("tiny", seed=7, weights="seeded")))


@pytest.mark.parametrize("config", ["preset", "directory"])
def test_an_sd_checkpoint_in_the_compvis_layout_gives_its_models_images(sd_file, tmp_path, config):
    """Seed 7's weights in the file, the config a preset (seed 0) or a directory of it: the file's weights win."""
    source = "tiny"
    if config == "directory":
        build_preset("tiny").as_pipeline().save_pretrained(tmp_path / "tiny", safe_serialization=True)
        source = str(tmp_path / "tiny")
    loaded = load_single_file(sd_file, source)
    expected = _images(build_preset("tiny", seed=7, weights="seeded"), "tiny")
    assert np.abs(_images(loaded, "tiny") - expected).max() <= 1e-5
    assert np.abs(_images(build_preset("tiny", weights="seeded"), "tiny") - expected).max() > 0.01  # seed 0's differ


def test_an_sdxl_checkpoint_with_both_text_encoders_gives_its_models_images(tmp_path):
    """The second encoder in OpenCLIP's layout (fused attention projections), told from the first by its width."""
    seeded = build_preset("sdxl-tiny", seed=7)
    path = write_single_file(tmp_path / "xl.safetensors", sdxl_checkpoint(seeded))
    assert checkpoint_family(path) == "sdxl"
    loaded = load_single_file(path, "sdxl-tiny")
    assert np.abs(_images(loaded, "sdxl-tiny") - _images(build_preset("sdxl-tiny", seed=7), "sdxl-tiny")).max() <= 1e-5


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["bfl", "comfyui"])
def test_a_flux_transformer_file_gives_its_models_images(tmp_path, prefix):
    """A Flux file holds only the transformer; the encoders and the VAE come from the config."""
    seeded = build_preset("flux-tiny", seed=7, weights="seeded")
    path = write_single_file(tmp_path / "flux.safetensors", flux_checkpoint(seeded.denoiser, prefix))
    assert checkpoint_family(path) == "flux"
    loaded = load_single_file(path, "flux-tiny")
    expected = build_preset("flux-tiny", weights="seeded")
    expected.denoiser = seeded.denoiser
    assert np.abs(_images(loaded, "flux-tiny") - _images(expected, "flux-tiny")).max() <= 1e-5


def test_the_model_config_loads_a_single_file(sd_file):
    config = DiffusionModelConfig(name="mine", preset=None, single_file=sd_file, config="tiny", device="cpu")
    loaded = load_components(config)
    assert loaded.family == "sd"
    np.testing.assert_allclose(_images(loaded, "tiny"),
                               _images(build_preset("tiny", seed=7, weights="seeded"), "tiny"), atol=1e-5)


def test_a_pickled_checkpoint_is_refused_unopened(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"\x80\x04 not opened")
    with pytest.raises(SingleFileError, match=r"model\.ckpt: only \.safetensors single files are loaded"):
        load_single_file(path, "tiny")
    with pytest.raises(ValidationError, match=r"single_file: only \.safetensors"):
        DiffusionModelConfig(preset=None, single_file=path, config="tiny")


def test_a_file_of_another_family_than_its_config_is_refused_naming_both(sd_file, tmp_path):
    with pytest.raises(SingleFileError, match="holds a sd model, and config 'flux-tiny' is a flux model"):
        load_single_file(sd_file, "flux-tiny")
    flux = write_single_file(tmp_path / "flux.safetensors", flux_checkpoint(build_preset("flux-tiny").denoiser))
    with pytest.raises(SingleFileError, match="holds a flux model, and config 'sdxl-tiny' is a sdxl model"):
        load_single_file(flux, "sdxl-tiny")


def test_files_of_no_known_layout_or_of_a_family_not_served_are_refused(tmp_path):
    unknown = write_single_file(tmp_path / "other.safetensors", {"encoder.weight": torch.zeros(2)})
    with pytest.raises(SingleFileError, match="no UNet or transformer of a known layout"):
        load_single_file(unknown, "tiny")
    sd3 = write_single_file(tmp_path / "sd3.safetensors",
                            {"joint_blocks.0.context_block.attn.qkv.weight": torch.zeros(6, 2)})
    with pytest.raises(SingleFileError, match="a sd3 checkpoint; single files are served for sd, sdxl, flux"):
        load_single_file(sd3, "sd3-tiny")
    not_safetensors = tmp_path / "broken.safetensors"
    not_safetensors.write_bytes(b"\x00" * 16)
    with pytest.raises(SingleFileError, match=r"broken\.safetensors: not a safetensors file"):
        load_single_file(not_safetensors, "tiny")


def test_config_must_name_a_preset_or_a_diffusers_directory(sd_file, tmp_path):
    with pytest.raises(SingleFileError, match=r"config: .* is not a diffusers model directory"):
        load_single_file(sd_file, str(tmp_path))
    with pytest.raises(ValidationError, match="`single_file` needs `config`"):
        DiffusionModelConfig(preset=None, single_file=sd_file)
    with pytest.raises(ValidationError, match="set exactly one of `preset`, `path`, `single_file`"):
        DiffusionModelConfig(single_file=sd_file, config="tiny")  # preset defaults to tiny: two sources
