"""The diffusion training recipe (a smoke run of every stage), the evaluation scores, and bundled LoRAs."""

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from serving.config import DiffusionAppConfig
from serving.controlnet.models import load_controlnet
from serving.lora.format import LoRATargets, load_lora_file
from serving.preset_catalog import preset_weights
from serving.presets import build_preset, load_local
from training.shapes import evaluation, parse_caption, short_caption
from training.shapes.world import COLOURS, SHAPES, STYLE_WORLDS, Description
from training.tiny_diffusion import StageSettings, main


def test_briefs_cover_every_colour_and_shape_pair_before_repeating():
    briefs = evaluation.briefs(len(COLOURS) * len(SHAPES) + 5)
    first = [(b.sample.attributes.colour, b.sample.attributes.shape) for b in briefs[:30]]
    assert len(set(first)) == 30
    assert briefs[0].prompt == briefs[0].sample.caption
    assert evaluation.briefs(3, short=True)[0].prompt == short_caption(briefs[0].sample.attributes)
    again = evaluation.briefs(3)
    assert [b.prompt for b in again] == [b.prompt for b in briefs[:3]]
    assert all(np.array_equal(a.sample.image, b.sample.image) for a, b in zip(again, briefs, strict=False))


def test_scores_of_the_generators_own_images_are_perfect_and_mismatches_score_low():
    briefs = evaluation.briefs(30)
    images = [brief.sample.image for brief in briefs]
    scores = evaluation.fidelity(images, briefs)
    assert scores["colour"] == 1.0 and scores["shape"] >= 0.95
    assert evaluation.control_iou(images, briefs) >= 0.99
    shifted = briefs[1:] + briefs[:1]  # every image judged against another brief
    assert evaluation.fidelity(images, shifted)["colour"] <= 0.3
    assert evaluation.control_iou(images, shifted) <= 0.5
    assert evaluation.style(images) == {"outline": pytest.approx(0.0, abs=0.02), "darkness": 0.0}


def test_to_uint8_rounds_float_images_and_keeps_uint8_ones():
    floats = np.array([[[[0.0, 0.5, 1.2]]]])
    assert evaluation.to_uint8(floats)[0].tolist() == [[[0, 128, 255]]]
    assert evaluation.to_uint8([np.zeros((1, 1, 3), np.uint8)])[0].dtype == np.uint8


def test_short_captions_parse_as_filled_on_white():
    description = Description(shape="star", colour="orange")
    assert short_caption(description) == "an orange star"
    assert parse_caption("an orange star") == description


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    stage = StageSettings(steps=1000, batch_size=1, learning_rate=1.0, warmup_steps=100)
    assert stage.learning_rate_at(0) == pytest.approx(0.01)
    assert stage.learning_rate_at(99) == pytest.approx(1.0)
    assert stage.learning_rate_at(100) == pytest.approx(1.0)
    assert stage.learning_rate_at(999) == pytest.approx(0.1, abs=1e-4)
    rates = [stage.learning_rate_at(step) for step in range(100, 1000)]
    assert all(a >= b for a, b in itertools.pairwise(rates))


@pytest.mark.slow
def test_training_recipe_smoke_run_writes_a_preset_the_server_loads(tmp_path: Path):
    out = tmp_path / "tiny"
    assert main(["--scale", "0.002", "--work", str(tmp_path / "work"), "--out", str(out), "--threads", "1",
                 "--stages", "vae,text_to_image,controlnet,lora,ship"]) == 0
    trained, seeded = load_local(out), build_preset("tiny")
    assert trained.vae.config.scaling_factor != seeded.vae.config.scaling_factor  # set from the latents
    for name, module in trained.modules().items():
        reference = seeded.modules()[name].state_dict()
        state = module.state_dict()
        assert state.keys() == reference.keys()
        assert any(not torch.equal(state[key], reference[key]) for key in state), name  # it trained
    controlnet = load_controlnet(out / "controlnet")
    assert controlnet.controlnet_down_blocks[0].weight.abs().sum() > 0  # zero convolutions moved off zero
    targets = LoRATargets.from_modules(trained.denoiser, trained.text_encoder)
    for style in STYLE_WORLDS:
        weights = load_lora_file(out / "loras" / f"{style}.safetensors", targets, max_file_bytes=2**30)
        assert weights.denoiser and not weights.text_encoder
    record = (out / "training.json").read_text()
    assert '"text_to_image"' in record and '"loss_curve"' in record


def test_bundled_loras_resolve_to_the_models_own_folder(tmp_path: Path):
    config = DiffusionAppConfig.model_validate({"lora": {"directory": "bundled"}})
    assert config.lora_directory() == preset_weights("tiny") / "loras"
    assert {path.stem for path in config.lora_directory().glob("*.safetensors")} == set(STYLE_WORLDS)
    local = tmp_path / "model"
    (local / "loras").mkdir(parents=True)
    config = DiffusionAppConfig.model_validate(
        {"model": {"preset": None, "path": str(local)}, "lora": {"directory": "bundled"}})
    assert config.lora_directory() == local / "loras"
    explicit = DiffusionAppConfig.model_validate({"lora": {"directory": str(tmp_path)}})
    assert explicit.lora_directory() == tmp_path
    assert DiffusionAppConfig().lora_directory() is None


def test_bundled_loras_refused_for_a_model_without_them():
    with pytest.raises(ValidationError, match=r"lora\.directory"):
        DiffusionAppConfig.model_validate({"model": {"weights": "seeded"}, "lora": {"directory": "bundled"}})
    with pytest.raises(ValidationError, match="weights"):
        DiffusionAppConfig.model_validate({"model": {"weights": "trained"}})

