"""SD3 LoRA files (diffusers' ``StableDiffusion3Pipeline`` format) -> LoRAWeights, checked against what diffusers
itself fuses from the same file; LoRAs of one family refused by a model of another, naming the family they need."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from serving.lora import LoRAFormatError, LoRATargets, load_lora_file
from serving.presets import build_preset
from tests.helpers.lora_files import write_lora
from tests.unit.serving.lora.test_format import diffusers_deltas, our_deltas

MAX_BYTES = 16 * 2**20
#: the MMDiT's joint attention (image and context streams), a feed-forward, the output projection, and the patch
#: embedding (a strided Conv2d)
TRANSFORMER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                       "ff.net.2", "proj_out", "pos_embed.proj"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1"]
TO_Q = "transformer_blocks.0.attn.to_q"


@pytest.fixture(scope="module")
def targets() -> LoRATargets:
    sd3 = build_preset("sd3-tiny")
    return LoRATargets.from_modules(sd3.denoiser, sd3.text_encoder, sd3.text_encoder_2)


def write_sd3_lora(path: Path, *, seed: int, transformer: LoraConfig, text_encoder: LoraConfig | None = None,
                   text_encoder_2: LoraConfig | None = None, metadata: bool = False,
                   diffusers_keys: bool = False) -> Path:
    """PEFT adapters on a fresh sd3-tiny (random non-zero factors), saved by ``StableDiffusion3Pipeline``: PEFT
    key names (``lora_A``), as diffusers' SD3 training scripts save them, or with ``diffusers_keys`` its older
    ones (``lora.down``); with ``metadata``, each adapter's ``LoraConfig`` as adapter metadata."""
    model = build_preset("sd3-tiny", seed=seed)
    adapters = {"transformer": (model.denoiser, transformer), "text_encoder": (model.text_encoder, text_encoder),
                "text_encoder_2": (model.text_encoder_2, text_encoder_2)}
    kwargs = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, (module, config) in adapters.items():
            if config is None:
                continue
            module.add_adapter(config)
            state = get_peft_model_state_dict(module)
            assert all(tensor.abs().sum() > 0 for key, tensor in state.items() if "lora_B" in key)
            kwargs[f"{name}_lora_layers"] = convert_state_dict_to_diffusers(state) if diffusers_keys else state
            if metadata:
                kwargs[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
    StableDiffusion3Pipeline.save_lora_weights(path.parent, weight_name=path.name, **kwargs)
    return path


def _config(r: int = 4, alpha: float = 4, targets: list[str] = TRANSFORMER_TARGETS, **kwargs) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **kwargs)


CASES = {
    # no metadata: diffusers derives the config from the factors (scale 1, the odd ranks as anchored patterns)
    "peft-keys-mixed-ranks": lambda path: write_sd3_lora(
        path, seed=1, transformer=_config(rank_pattern={TO_Q: 2, "proj_out": 8}),
        text_encoder=_config(targets=TEXT_TARGETS), text_encoder_2=_config(r=2, alpha=2, targets=TEXT_TARGETS)),
    "diffusers-keys": lambda path: write_sd3_lora(
        path, seed=2, diffusers_keys=True, transformer=_config(targets=["to_q", "to_k", "to_v", "to_out.0"]),
        text_encoder=_config(targets=TEXT_TARGETS[:4]), text_encoder_2=_config(targets=TEXT_TARGETS[:4])),
    # metadata: rank and alpha per module from the LoraConfig diffusers saved
    "metadata-patterns": lambda path: write_sd3_lora(
        path, seed=3, metadata=True,
        transformer=_config(alpha=8, rank_pattern={TO_Q: 2}, alpha_pattern={"add_k_proj": 2}),
        text_encoder=_config(alpha=2, targets=TEXT_TARGETS),
        text_encoder_2=_config(r=8, alpha=3, targets=TEXT_TARGETS, use_rslora=True)),
    "metadata-transformer-only": lambda path: write_sd3_lora(
        path, seed=4, metadata=True, transformer=_config(alpha=6, use_rslora=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sd3_deltas_match_diffusers_fuse_lora(case, targets, tmp_path):
    path = CASES[case](tmp_path / f"{case}.safetensors")
    weights = load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    reference = diffusers_deltas(path, "sd3-tiny")
    assert reference["denoiser"], "diffusers applied nothing: the test file is wrong"
    for component in ("denoiser", "text_encoder", "text_encoder_2"):
        ours = our_deltas(weights, component)
        assert set(ours) == set(reference[component]), component
        for name, delta in ours.items():
            torch.testing.assert_close(delta.view_as(reference[component][name]), reference[component][name],
                                       atol=1e-6, rtol=0, msg=f"{component} {name}")
    assert weights.name == case


def test_sd3_scales_come_from_the_adapter_metadata(targets, tmp_path):
    weights = load_lora_file(CASES["metadata-patterns"](tmp_path / "meta.safetensors"), targets,
                             max_file_bytes=MAX_BYTES)
    assert weights.denoiser[TO_Q].rank == 2 and weights.denoiser[TO_Q].scale == 8 / 2
    assert weights.denoiser["transformer_blocks.1.attn.add_k_proj"].scale == 2 / 4
    assert weights.denoiser["transformer_blocks.1.attn.to_q"].scale == 8 / 4
    assert weights.denoiser["pos_embed.proj"].down.shape == (4, 16, 2, 2)
    assert {layer.scale for layer in weights.text_encoder.values()} == {2 / 4}
    assert {layer.scale for layer in weights.text_encoder_2.values()} == {3 / 8**0.5}  # rsLoRA: alpha / sqrt(r)


def _metadata_lora(path: Path, targets: LoRATargets, config: dict) -> Path:
    """One ``transformer.`` module's factors (rank 4) with ``config`` as the adapter metadata."""
    down, up = targets.denoiser[TO_Q].factor_shapes(4)
    generator = torch.Generator().manual_seed(0)
    save_file({f"transformer.{TO_Q}.lora_A.weight": torch.randn(down, generator=generator),
               f"transformer.{TO_Q}.lora_B.weight": torch.randn(up, generator=generator)}, str(path),
              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    return path


def test_sd3_metadata_is_read_under_the_transformer_prefix(targets, tmp_path):
    path = _metadata_lora(tmp_path / "meta.safetensors", targets, {"transformer.r": 4, "transformer.lora_alpha": 6})
    assert load_lora_file(path, targets, max_file_bytes=MAX_BYTES).denoiser[TO_Q].scale == 1.5
    path = _metadata_lora(tmp_path / "unet-meta.safetensors", targets, {"unet.r": 4, "unet.lora_alpha": 6})
    with pytest.raises(LoRAFormatError, match="adapter metadata has no transformer entry"):
        load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    path = _metadata_lora(tmp_path / "rank.safetensors", targets, {"transformer.r": 8})
    with pytest.raises(LoRAFormatError, match="rank 4 but the LoRA config says r=8"):
        load_lora_file(path, targets, max_file_bytes=MAX_BYTES)


def test_targets_record_the_family(targets):
    assert targets.family == "sd3" and targets.denoiser_prefix == "transformer"
    assert targets.denoiser["pos_embed.proj"].kind == "conv2d"
    assert targets.text_encoder_2 and targets.text_encoder_nested
    assert pickle.loads(pickle.dumps(targets)) == targets
    sdxl, sd = build_preset("sdxl-tiny"), build_preset("tiny")
    assert LoRATargets.from_modules(sdxl.denoiser, sdxl.text_encoder, sdxl.text_encoder_2).family == "sdxl"
    assert LoRATargets.from_modules(sd.denoiser, sd.text_encoder).family == "sd"


# --- one family's LoRA on another family's model -----------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "sdxl-tiny"])
def test_an_sd3_lora_on_a_unet_model_names_the_sd3_family(preset, tmp_path):
    path = write_lora(tmp_path / "sd3.safetensors", seed=5, text_encoder=True, preset="sd3-tiny")
    model = build_preset(preset)
    targets = LoRATargets.from_modules(model.denoiser, model.text_encoder, model.text_encoder_2)
    with pytest.raises(LoRAFormatError, match=f"a LoRA for the sd3 family, and this model is {model.family}"):
        load_lora_file(path, targets, max_file_bytes=MAX_BYTES)


@pytest.mark.parametrize(("preset", "text_encoder", "family"), [
    ("tiny", True, "sd or sdxl"),
    ("sdxl-tiny", False, "sd or sdxl"),  # a UNet-only file: SD and SDXL LoRAs look alike
    ("sdxl-tiny", True, "sdxl"),  # a second text encoder's part: SDXL's
])
def test_a_unet_lora_on_an_sd3_model_names_the_family_it_needs(preset, text_encoder, family, targets, tmp_path):
    path = write_lora(tmp_path / "unet.safetensors", seed=5, text_encoder=text_encoder, preset=preset)
    with pytest.raises(LoRAFormatError, match=f"a LoRA for the {family} family, and this model is sd3"):
        load_lora_file(path, targets, max_file_bytes=MAX_BYTES)


def test_kohya_files_on_sd3(targets, tmp_path):
    """kohya-style files are refused by an sd3 model (diffusers' SD3 pipeline cannot load them either), naming the
    family when the keys tell it; an SD3 kohya file is refused by a UNet model as sd3's."""
    down, up = torch.randn(4, 32), torch.randn(32, 4)
    kohya = {
        "unet-blocks": ("lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q",
                        "a LoRA for the sd or sdxl family"),
        "mmdit": ("lora_unet_joint_blocks_0_x_block_attn_qkv", "kohya-style LoRA files are not supported for the sd3"),
        "text-only": ("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", "kohya-style LoRA files are not"),
    }
    for case, (key, match) in kohya.items():
        path = tmp_path / f"{case}.safetensors"
        save_file({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(4.0)},
                  str(path))
        with pytest.raises(LoRAFormatError, match=match):
            load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    sd = build_preset("tiny")
    with pytest.raises(LoRAFormatError, match="a LoRA for the sd3 family"):
        load_lora_file(tmp_path / "mmdit.safetensors", LoRATargets.from_modules(sd.denoiser, sd.text_encoder),
                       max_file_bytes=MAX_BYTES)


def test_sd3_files_without_transformer_weights_or_with_t5_weights_are_refused(targets, tmp_path):
    down, up = targets.text_encoder["text_model.encoder.layers.0.self_attn.q_proj"].factor_shapes(4)
    text = {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(down),
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(up)}
    save_file(text, str(tmp_path / "te.safetensors"))
    with pytest.raises(LoRAFormatError, match="the file has no transformer LoRA weights"):
        load_lora_file(tmp_path / "te.safetensors", targets, max_file_bytes=MAX_BYTES)
    t5 = {f"transformer.{TO_Q}.lora_A.weight": torch.randn(4, 32),
          f"transformer.{TO_Q}.lora_B.weight": torch.randn(32, 4),
          "text_encoder_3.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.randn(4, 64)}
    save_file(t5, str(tmp_path / "t5.safetensors"))
    with pytest.raises(LoRAFormatError, match=r"'text_encoder_3\..*not a transformer or text encoder LoRA weight"):
        load_lora_file(tmp_path / "t5.safetensors", targets, max_file_bytes=MAX_BYTES)
