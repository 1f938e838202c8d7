"""LoRA files -> LoRAWeights: checked against what diffusers itself does with the same file."""

from __future__ import annotations

import json
import math
import pickle
import struct
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

import serving.lora.format as lora_format
from serving.lora import LoRAFormatError, LoRATargets, LoRAWeights, load_lora_file
from serving.presets import build_preset
from tests.helpers.lora_files import write_lora

MAX_BYTES = 16 * 2**20
UNET_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]
FUSE_SCALE = 0.7

# kohya-style targets on the tiny UNet / text encoder: attention, feed-forward, 1x1 and 3x3 convolutions
KOHYA_UNET = [
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_v",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0",
    "down_blocks.1.attentions.0.transformer_blocks.0.ff.net.0.proj",
    "down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2",
    "down_blocks.1.attentions.0.proj_in",
    "down_blocks.1.resnets.0.conv1",
    "down_blocks.1.resnets.0.time_emb_proj",
    "down_blocks.1.resnets.0.conv_shortcut",
    "mid_block.attentions.0.transformer_blocks.0.attn2.to_v",
    "up_blocks.0.attentions.1.proj_out",
]
KOHYA_TEXT = [f"encoder.layers.0.self_attn.{name}" for name in TEXT_ATTENTION] + [
    "encoder.layers.1.mlp.fc1",
    "encoder.layers.1.mlp.fc2",
]


@pytest.fixture(scope="module")
def targets() -> LoRATargets:
    tiny = build_preset("tiny")
    return LoRATargets.from_modules(tiny.denoiser, tiny.text_encoder)


# --- writing LoRA files ------------------------------------------------------------------------------------------


def write_peft_lora(path: Path, *, seed: int, unet: LoraConfig, text_encoder: LoraConfig | None = None,
                    metadata: bool = False) -> Path:
    """A diffusers-format file the way diffusers' tests make one: PEFT adapters on a fresh preset copy."""
    model = build_preset("tiny", seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.denoiser.add_adapter(unet)
        kwargs = {"unet_lora_layers": convert_state_dict_to_diffusers(get_peft_model_state_dict(model.denoiser))}
        if text_encoder is not None:
            model.text_encoder.add_adapter(text_encoder)
            kwargs["text_encoder_lora_layers"] = convert_state_dict_to_diffusers(
                get_peft_model_state_dict(model.text_encoder))
    if metadata:
        kwargs["unet_lora_adapter_metadata"] = model.denoiser.peft_config["default"].to_dict()
        if text_encoder is not None:
            kwargs["text_encoder_lora_adapter_metadata"] = model.text_encoder.peft_config["default"].to_dict()
    StableDiffusionPipeline.save_lora_weights(path.parent, weight_name=path.name, **kwargs)
    return path


def kohya_tensors(targets: LoRATargets, *, seed: int, unet: list[str], text: list[str] = (), text_2: list[str] = (),
                  alphas: dict[str, float] | None = None, ranks: dict[str, int] | None = None,
                  default_alpha: float = 2.0, default_rank: int = 4) -> dict[str, torch.Tensor]:
    """kohya-ss keys (``lora_unet_<path with _>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``); the text
    encoders as ``lora_te_`` (one) or ``lora_te1_`` and ``lora_te2_`` (SDXL's two)."""
    alphas, ranks = alphas or {}, ranks or {}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    first = "lora_te1_text_model_" if targets.text_encoder_2 else "lora_te_text_model_"
    for prefix, names, shapes in (("lora_unet_", unet, targets.denoiser), (first, text, targets.text_encoder),
                                  ("lora_te2_text_model_", text_2, targets.text_encoder_2)):
        for name in names:
            shape, rank = shapes[name], ranks.get(name, default_rank)
            down, up = shape.factor_shapes(rank)
            key = prefix + name.removeprefix("text_model.").replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = torch.randn(down, generator=generator) * 0.3
            tensors[f"{key}.lora_up.weight"] = torch.randn(up, generator=generator) * 0.3
            tensors[f"{key}.alpha"] = torch.tensor(alphas.get(name, default_alpha))
    return tensors


def write_kohya_lora(path: Path, targets: LoRATargets, **kwargs) -> Path:
    save_file(kohya_tensors(targets, **kwargs), str(path))
    return path


def peft_keys_lora(path: Path, targets: LoRATargets, modules: list[str], *, seed: int = 0,
                   rank: int = 4) -> dict[str, torch.Tensor]:
    """PEFT-format UNet tensors (``unet.<module>.lora_A.weight``) for ``modules``."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in modules:
        down, up = targets.denoiser[module].factor_shapes(rank)
        tensors[f"unet.{module}.lora_A.weight"] = torch.randn(down, generator=generator)
        tensors[f"unet.{module}.lora_B.weight"] = torch.randn(up, generator=generator)
    return tensors


# --- the reference: diffusers loads and fuses the same file ------------------------------------------------------


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: module.weight.detach().clone() for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear | torch.nn.Conv2d)}


def diffusers_deltas(path: Path, preset: str = "tiny") -> dict[str, dict[str, torch.Tensor]]:
    """``fused_W - base_W`` for every module diffusers changed, after ``load_lora_weights`` + ``fuse_lora(0.7)``,
    per component as ``LoRAWeights`` names them (``denoiser``: the pipeline's ``unet`` or ``transformer``)."""
    model = build_preset(preset)
    pipeline_names = {"denoiser": "transformer" if model.family == "sd3" else "unet", "text_encoder": "text_encoder",
                      "text_encoder_2": "text_encoder_2"}  # the CLIP encoders; SD3's T5 takes no LoRA
    modules = {name: module for name, module in model.modules().items() if name in pipeline_names}
    before = {name: _weights(module) for name, module in modules.items()}
    pipe = model.as_pipeline()
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora(components=[pipeline_names[name] for name in modules], lora_scale=FUSE_SCALE)
    pipe.unload_lora_weights()  # keeps the fused weights, removes the adapter wrappers
    after = {name: _weights(module) for name, module in modules.items()}
    return {component: {name: after[component][name] - weight for name, weight in before[component].items()
                        if not torch.equal(after[component][name], weight)}
            for component in before}


def our_deltas(weights: LoRAWeights, component: str) -> dict[str, torch.Tensor]:
    layers = getattr(weights, component)
    return {name: FUSE_SCALE * layer.scale * (layer.up.flatten(1) @ layer.down.flatten(1)) for name, layer in
            layers.items()}


CASES = {
    "diffusers-unet-alpha-eq-r": lambda path, targets: write_peft_lora(
        path, seed=1, unet=LoraConfig(r=4, lora_alpha=4, target_modules=UNET_ATTENTION, init_lora_weights=False)),
    "diffusers-unet-te-alpha-eq-r": lambda path, targets: write_peft_lora(
        path, seed=2, unet=LoraConfig(r=4, lora_alpha=4, target_modules=UNET_ATTENTION, init_lora_weights=False),
        text_encoder=LoraConfig(r=4, lora_alpha=4, target_modules=TEXT_ATTENTION, init_lora_weights=False)),
    "diffusers-metadata-patterns": lambda path, targets: write_peft_lora(
        path, seed=3, metadata=True,
        unet=LoraConfig(r=4, lora_alpha=8, target_modules=UNET_ATTENTION, init_lora_weights=False,
                        rank_pattern={"attn1.to_q": 2}, alpha_pattern={"attn2.to_k": 3}),
        text_encoder=LoraConfig(r=4, lora_alpha=2, target_modules=TEXT_ATTENTION, init_lora_weights=False)),
    "diffusers-metadata-rslora-unet-only": lambda path, targets: write_peft_lora(
        path, seed=4, metadata=True,
        unet=LoraConfig(r=4, lora_alpha=6, target_modules=["proj_in", "conv1", "time_emb_proj", "ff.net.2"],
                        init_lora_weights=False, use_rslora=True)),
    "kohya-unet-alpha-ne-r": lambda path, targets: write_kohya_lora(path, targets, seed=5, unet=KOHYA_UNET),
    "kohya-unet-te-alpha-ne-r": lambda path, targets: write_kohya_lora(
        path, targets, seed=6, unet=KOHYA_UNET, text=KOHYA_TEXT, default_alpha=1.0),
    # per-module alphas and ranks: diffusers resolves some of them (proj_in, conv1) and not others (attention
    # modules, whose converted alpha names never match a module); the loader must agree either way
    "kohya-mixed-alphas-and-ranks": lambda path, targets: write_kohya_lora(
        path, targets, seed=7, unet=KOHYA_UNET, text=KOHYA_TEXT,
        alphas={KOHYA_UNET[0]: 8.0, KOHYA_UNET[6]: 3.0, KOHYA_UNET[7]: 1.0, KOHYA_TEXT[0]: 5.0, KOHYA_TEXT[4]: 6.0},
        ranks={KOHYA_UNET[6]: 2, KOHYA_UNET[1]: 8}),
}


@pytest.mark.filterwarnings("ignore:The following alpha_pattern keys did not match:RuntimeWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_deltas_match_diffusers_fuse_lora(case, targets, tmp_path):
    path = CASES[case](tmp_path / f"{case}.safetensors", targets)
    weights = load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    reference = diffusers_deltas(path)
    assert reference["denoiser"], "diffusers applied nothing: the test file is wrong"
    for component in ("denoiser", "text_encoder"):
        ours = our_deltas(weights, component)
        assert set(ours) == set(reference[component]), component
        for name, delta in ours.items():
            torch.testing.assert_close(delta.view_as(reference[component][name]), reference[component][name],
                                       atol=1e-5, rtol=0, msg=f"{component} {name}")
    assert weights.name == case
    assert weights.nbytes == sum(layer.down.nbytes + layer.up.nbytes
                                 for layers in (weights.denoiser, weights.text_encoder) for layer in layers.values())


SDXL_KOHYA_UNET = [
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k",
    "down_blocks.1.attentions.0.proj_in",
    "down_blocks.1.resnets.0.conv1",
    "mid_block.attentions.0.transformer_blocks.0.attn2.to_v",
    "up_blocks.0.attentions.1.proj_out",
]


def test_an_sdxl_kohya_lora_on_both_text_encoders_matches_diffusers_fuse_lora(tmp_path):
    """``lora_te1_`` / ``lora_te2_`` keys land on SDXL's first and second text encoder, as diffusers puts them."""
    sdxl = build_preset("sdxl-tiny")
    targets = LoRATargets.from_modules(sdxl.denoiser, sdxl.text_encoder, sdxl.text_encoder_2)
    text_2 = [f"text_model.{name}" for name in KOHYA_TEXT[3:]]  # CLIPTextModelWithProjection nests its modules
    path = write_kohya_lora(tmp_path / "xl.safetensors", targets, seed=8, unet=SDXL_KOHYA_UNET, text=KOHYA_TEXT,
                            text_2=text_2, default_alpha=1.0)
    weights = load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    reference = diffusers_deltas(path, "sdxl-tiny")
    for component, names in (("denoiser", SDXL_KOHYA_UNET), ("text_encoder", KOHYA_TEXT), ("text_encoder_2", text_2)):
        ours = our_deltas(weights, component)
        assert set(ours) == set(reference[component]) == set(names), component
        for name, delta in ours.items():
            torch.testing.assert_close(delta.view_as(reference[component][name]), reference[component][name],
                                       atol=1e-5, rtol=0, msg=f"{component} {name}")
    assert weights.modules == len(SDXL_KOHYA_UNET) + len(KOHYA_TEXT) + 3


def test_kohya_scales_and_layout(targets, tmp_path):
    path = write_kohya_lora(tmp_path / "k.safetensors", targets, seed=0, unet=KOHYA_UNET, text=KOHYA_TEXT,
                            default_alpha=2.0)
    weights = load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    assert set(weights.denoiser) == set(KOHYA_UNET) and set(weights.text_encoder) == set(KOHYA_TEXT)
    assert {layer.scale for layer in (*weights.denoiser.values(), *weights.text_encoder.values())} == {0.5}
    conv = weights.denoiser["down_blocks.1.resnets.0.conv1"]
    assert conv.down.shape == (4, 32, 3, 3) and conv.up.shape == (64, 4, 1, 1)
    linear = weights.denoiser["down_blocks.1.resnets.0.time_emb_proj"]
    assert linear.down.shape == (4, 128) and linear.up.shape == (64, 4)
    for layer in weights.denoiser.values():
        assert layer.down.dtype == torch.float32 and layer.down.is_contiguous() and layer.up.is_contiguous()


def test_no_alphas_means_scale_one(targets, tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file(peft_keys_lora(path, targets, KOHYA_UNET[:2]), str(path))
    weights = load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    assert {layer.scale for layer in weights.denoiser.values()} == {1.0}


def test_dtype_and_to(targets, tmp_path):
    path = write_kohya_lora(tmp_path / "k.safetensors", targets, seed=0, unet=KOHYA_UNET[:2])
    half = load_lora_file(path, targets, max_file_bytes=MAX_BYTES, dtype=torch.float16)
    full = load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    assert all(layer.down.dtype == torch.float16 for layer in half.denoiser.values())
    assert half.nbytes * 2 == full.nbytes
    moved = full.to("cpu", torch.bfloat16)
    assert moved.nbytes == half.nbytes and moved.denoiser[KOHYA_UNET[0]].up.dtype == torch.bfloat16
    assert full.denoiser[KOHYA_UNET[0]].up.dtype == torch.float32  # the cached copy is untouched


def test_text_encoder_keys_resolve_by_unique_suffix(targets, tmp_path):
    path = tmp_path / "te.safetensors"
    tensors = peft_keys_lora(path, targets, KOHYA_UNET[:1])
    shape = targets.text_encoder["encoder.layers.0.self_attn.q_proj"]
    down, up = shape.factor_shapes(4)
    tensors["text_encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.randn(down)
    tensors["text_encoder.layers.0.self_attn.q_proj.lora_B.weight"] = torch.randn(up)
    save_file(tensors, str(path))
    assert set(load_lora_file(path, targets, max_file_bytes=MAX_BYTES).text_encoder) == {
        "encoder.layers.0.self_attn.q_proj"}


def test_targets_are_shapes_only_and_picklable(targets):
    assert pickle.loads(pickle.dumps(targets)) == targets
    assert targets.denoiser["down_blocks.1.resnets.0.conv1"].kernel_size == (3, 3)
    assert targets.text_encoder["encoder.layers.1.mlp.fc1"].out_features == 128
    assert "conv_in" in targets.denoiser and not targets.text_encoder_nested
    assert targets.family == "sd" and targets.denoiser_prefix == "unet"


# --- refused files -----------------------------------------------------------------------------------------------


def _refused(path: Path, targets: LoRATargets, match: str, **kwargs) -> LoRAFormatError:
    with pytest.raises(LoRAFormatError, match=match) as info:
        load_lora_file(path, targets, max_file_bytes=kwargs.pop("max_file_bytes", MAX_BYTES), **kwargs)
    assert path.name in str(info.value)
    return info.value


@pytest.fixture
def no_reads(monkeypatch):
    """Fails the test if the loader opens anything."""
    def refuse(*args, **kwargs):
        raise AssertionError("the file was opened")
    monkeypatch.setattr(lora_format, "safe_open", refuse)
    monkeypatch.setattr(torch, "load", refuse)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("suffix", [".bin", ".ckpt", ".pt", ".pkl"])
def test_pickle_files_are_refused_unopened(suffix, targets, tmp_path, no_reads):
    marker = tmp_path / "executed"
    path = tmp_path / f"evil{suffix}"
    path.write_bytes(pickle.dumps(_Payload(marker)))
    _refused(path, targets, "only .safetensors")
    assert not marker.exists()


def test_oversized_file_is_refused_before_reading(targets, tmp_path, no_reads):
    path = tmp_path / "big.safetensors"
    path.write_bytes(b"\0" * 4096)
    _refused(path, targets, "4096 bytes, over the 1000-byte limit", max_file_bytes=1000)


def test_corrupt_and_truncated_files(targets, tmp_path):
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(torch.randint(0, 256, (2048,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
                        .numpy().tobytes())
    _refused(corrupt, targets, "not a valid safetensors file")
    good = write_kohya_lora(tmp_path / "good.safetensors", targets, seed=0, unet=KOHYA_UNET)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _refused(truncated, targets, "not a valid safetensors file")
    _refused(tmp_path / "missing.safetensors", targets, "cannot read")


def test_wrong_shapes_are_refused(targets, tmp_path):
    name = "down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_k"
    cases = {
        "in-features": {"lora_down.weight": torch.randn(4, 32)},  # to_k takes 64 features
        "rank-mismatch": {"lora_up.weight": torch.randn(64, 3)},
        "conv-kernel": None,
    }
    for case, override in cases.items():
        tensors = kohya_tensors(targets, seed=0, unet=KOHYA_UNET)
        if override is None:  # 3x3 conv given a 1x1 down factor
            tensors["lora_unet_down_blocks_1_resnets_0_conv1.lora_down.weight"] = torch.randn(4, 32, 1, 1)
        else:
            tensors.update({f"lora_unet_{name}.{key}": value for key, value in override.items()})
        path = tmp_path / f"{case}.safetensors"
        save_file(tensors, str(path))
        error = _refused(path, targets, "does not fit")
        assert ("conv1" if override is None else "attn1.to_k") in str(error)


def test_linear_module_given_conv_factors_is_refused(targets, tmp_path):
    path = tmp_path / "dims.safetensors"
    tensors = peft_keys_lora(path, targets, KOHYA_UNET[:1])
    tensors[f"unet.{KOHYA_UNET[0]}.lora_A.weight"] = tensors[f"unet.{KOHYA_UNET[0]}.lora_A.weight"][..., None, None]
    save_file(tensors, str(path))
    _refused(path, targets, r"to_q.*does not fit Linear\(64, 64\)")


def test_unknown_ambiguous_and_duplicate_modules(targets, tmp_path):
    unknown = kohya_tensors(targets, seed=0, unet=KOHYA_UNET[:1])
    unknown.update({key.replace("down_blocks_1", "down_blocks_7"): value.clone() for key, value in unknown.items()})
    save_file(unknown, str(tmp_path / "unknown.safetensors"))
    _refused(tmp_path / "unknown.safetensors", targets, "down_blocks.7.*no Linear or Conv2d module")

    down, up = targets.denoiser[KOHYA_UNET[0]].factor_shapes(4)
    ambiguous = {"unet.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.randn(down),
                 "unet.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.randn(up)}
    save_file(ambiguous, str(tmp_path / "ambiguous.safetensors"))
    _refused(tmp_path / "ambiguous.safetensors", targets, "ambiguous")

    # "2.attentions..." names down_blocks.2's module only (no up block 2 has attentions): the same module twice
    duplicate = peft_keys_lora(tmp_path, targets, ["down_blocks.2.attentions.0.transformer_blocks.0.attn1.to_q"])
    duplicate.update({key.replace("unet.down_blocks.2.", "unet.2."): value.clone()
                      for key, value in duplicate.items()})
    save_file(duplicate, str(tmp_path / "duplicate.safetensors"))
    _refused(tmp_path / "duplicate.safetensors", targets, "again")


def test_incomplete_pairs_and_non_lora_keys(targets, tmp_path):
    half = peft_keys_lora(tmp_path, targets, KOHYA_UNET[:2])
    del half[f"unet.{KOHYA_UNET[1]}.lora_B.weight"]
    save_file(half, str(tmp_path / "half.safetensors"))
    _refused(tmp_path / "half.safetensors", targets, "no matching lora_B")

    stray = peft_keys_lora(tmp_path, targets, KOHYA_UNET[:1])
    stray["unet.conv_in.weight"] = torch.randn(32, 4, 3, 3)
    save_file(stray, str(tmp_path / "stray.safetensors"))
    _refused(tmp_path / "stray.safetensors", targets, "'unet.conv_in.weight'")

    other = peft_keys_lora(tmp_path, targets, KOHYA_UNET[:1])
    other["text_encoder_2.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.randn(4, 64)
    save_file(other, str(tmp_path / "sdxl.safetensors"))
    _refused(tmp_path / "sdxl.safetensors", targets, "weights for a second text encoder: a LoRA for the sdxl family")


@pytest.mark.parametrize(("extra", "match"), [
    ({"unet.{m}.lora_magnitude_vector": (64,)}, "DoRA"),
    ({"unet.{m}.lora_B.bias": (64,)}, "bias"),
    ({"unet.{m}.lokr_w1": (8, 8)}, "LoKr"),
])
def test_unsupported_variants(extra, match, targets, tmp_path):
    tensors = peft_keys_lora(tmp_path, targets, KOHYA_UNET[:1])
    tensors.update({key.format(m=KOHYA_UNET[0]): torch.randn(shape) for key, shape in extra.items()})
    save_file(tensors, str(tmp_path / "variant.safetensors"))
    _refused(tmp_path / "variant.safetensors", targets, match)


def test_kohya_dora_is_refused_not_silently_dropped(targets, tmp_path):
    # diffusers' lora_state_dict drops dora_scale with a warning and would apply a plain LoRA instead
    tensors = kohya_tensors(targets, seed=0, unet=KOHYA_UNET[:1])
    tensors[f"lora_unet_{KOHYA_UNET[0].replace('.', '_')}.dora_scale"] = torch.ones(1, 64)
    save_file(tensors, str(tmp_path / "dora.safetensors"))
    _refused(tmp_path / "dora.safetensors", targets, "dora_scale.*DoRA")


def test_non_finite_values_are_refused(targets, tmp_path):
    tensors = kohya_tensors(targets, seed=0, unet=KOHYA_UNET)
    tensors["lora_unet_down_blocks_1_resnets_0_conv1.lora_up.weight"][0, 0] = math.nan
    save_file(tensors, str(tmp_path / "nan.safetensors"))
    _refused(tmp_path / "nan.safetensors", targets, "conv1.*non-finite")

    overflow = kohya_tensors(targets, seed=0, unet=KOHYA_UNET[:1])  # finite in fp32, inf in fp16
    overflow[f"lora_unet_{KOHYA_UNET[0].replace('.', '_')}.lora_down.weight"][0, 0] = 1e6
    save_file(overflow, str(tmp_path / "overflow.safetensors"))
    load_lora_file(tmp_path / "overflow.safetensors", targets, max_file_bytes=MAX_BYTES)
    _refused(tmp_path / "overflow.safetensors", targets, "non-finite", dtype=torch.float16)

    inf_alpha = kohya_tensors(targets, seed=0, unet=KOHYA_UNET[:1], default_alpha=math.inf)
    save_file(inf_alpha, str(tmp_path / "alpha.safetensors"))
    _refused(tmp_path / "alpha.safetensors", targets, "lora_alpha")


def test_text_encoder_only_file_is_refused(targets, tmp_path):
    save_file(kohya_tensors(targets, seed=0, unet=[], text=KOHYA_TEXT), str(tmp_path / "te.safetensors"))
    _refused(tmp_path / "te.safetensors", targets, "no UNet LoRA")


def _with_metadata(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    save_file(tensors, str(path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    return path


def test_metadata_wins_and_is_validated(targets, tmp_path):
    tensors = peft_keys_lora(tmp_path, targets, KOHYA_UNET[:2])
    path = _with_metadata(tmp_path / "meta.safetensors", tensors,
                          {"unet.r": 4, "unet.lora_alpha": 2, "unet.alpha_pattern": {"attn1.to_k": 12}})
    weights = load_lora_file(path, targets, max_file_bytes=MAX_BYTES)
    assert weights.denoiser[KOHYA_UNET[0]].scale == 0.5 and weights.denoiser[KOHYA_UNET[1]].scale == 3.0

    bad = {
        "rank": ({"unet.r": 8, "unet.lora_alpha": 8}, "rank 4 but the LoRA config says r=8"),
        "dora": ({"unet.r": 4, "unet.use_dora": True}, "DoRA"),
        "regex": ({"unet.r": 4, "unet.alpha_pattern": {".*to_q": 2}}, "regular expressions"),
        "type": ({"unet.r": "4"}, "invalid r"),
        "no-unet-entry": ({"text_encoder.r": 4}, "no unet entry"),
    }
    for case, (config, match) in bad.items():
        _refused(_with_metadata(tmp_path / f"{case}.safetensors", tensors, config), targets, match)
    path = tmp_path / "json.safetensors"
    save_file(tensors, str(path), metadata={"lora_adapter_metadata": "{not json"})
    _refused(path, targets, "not JSON")


def test_mixed_key_layout_is_refused_where_diffusers_would_drop_modules(targets, tmp_path):
    # convert_state_dict_to_diffusers renames only attention keys; with a conv key first, diffusers skips the
    # attention modules (it converts key names only when the first key is not PEFT-style)
    path = write_peft_lora(tmp_path / "mixed.safetensors", seed=0, unet=LoraConfig(
        r=4, lora_alpha=4, target_modules=["conv1", *UNET_ATTENTION], init_lora_weights=False))
    _refused(path, targets, "attn1.to_k.lora.down.weight.*mixes PEFT")


def test_text_encoder_lora_b_below_two_dimensions_is_refused_not_an_index_error(targets, tmp_path):
    """Found by the Hypothesis properties: diffusers reads a text-encoder rank as ``lora_B.shape[1]``."""
    module = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    flat = peft_keys_lora(tmp_path, targets, KOHYA_UNET[:1])
    flat.update({f"{module}.lora_A.weight": torch.randn(4, 64), f"{module}.lora_B.weight": torch.randn(64)})
    save_file(flat, str(tmp_path / "flat.safetensors"))
    _refused(tmp_path / "flat.safetensors", targets, "no text_encoder LoRA module diffusers would take a rank from")


@pytest.mark.parametrize(("preset", "fits", "refused"), [
    ("tiny", ["tiny"], {"sdxl-tiny": "a LoRA for another model", "sd3-tiny": "a LoRA for the sd or sdxl family"}),
    ("sdxl-tiny", ["sdxl-tiny"], {"tiny": "a LoRA for the sdxl family", "sd3-tiny": "a LoRA for the sdxl family"}),
    ("sd3-tiny", ["sd3-tiny"], {"tiny": "a LoRA for the sd3 family", "sdxl-tiny": "a LoRA for the sd3 family"}),
])
def test_the_family_check_reads_only_the_header(tmp_path, preset, fits, refused):
    """``check_lora_family`` tells another model's LoRA by its header, names and shapes: a file cut after its header
    still passes where it may fit (no tensor is read), and is refused where it cannot, naming the family when the
    names tell it (a UNet-only SD LoRA's names are SDXL-like: its modules tell it apart)."""
    whole = write_lora(tmp_path / "style.safetensors", seed=1, text_encoder=True, preset=preset).read_bytes()
    (length,) = struct.unpack("<Q", whole[:8])
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole[:8 + length])
    for model in fits:
        lora_format.check_lora_family(cut, _targets(model), max_file_bytes=2**30)
    for model, message in refused.items():
        with pytest.raises(LoRAFormatError, match=message):
            lora_format.check_lora_family(cut, _targets(model), max_file_bytes=2**30)


@pytest.mark.parametrize(("factors", "message"), [
    ({"lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight": (4, 768)},
     "takes a text conditioning 768 wide, and this sd model's is 64"),  # kohya keys: an SD 1.x LoRA
    ({"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight": (4, 2048)},
     "takes a text conditioning 2048 wide"),  # PEFT keys: an SDXL LoRA
    ({"unet.down_blocks.9.attentions.0.proj_in.lora.down.weight": (4, 32)},
     "this sd model has no module 'down_blocks.9.attentions.0.proj_in'"),
    ({"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight": (128, 4)},
     "is 128 wide where 'down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q' is Linear"),
])
def test_the_header_check_refuses_a_lora_whose_shapes_fit_another_model(targets, tmp_path, factors, message):
    path = tmp_path / "other.safetensors"
    save_file({key: torch.zeros(shape) for key, shape in factors.items()}, str(path))
    with pytest.raises(LoRAFormatError, match=message):
        lora_format.check_lora_family(path, targets, max_file_bytes=2**30)


def test_the_header_check_resolves_a_module_suffix_as_the_loader_does(targets, tmp_path):
    """``linear_1`` ends one module name of the tiny UNet (``time_embedding.linear_1``): the file loads, so the
    header check passes it; ``proj_in`` ends several, which the loader refuses, and so does the check."""
    unique = tmp_path / "suffix.safetensors"
    save_file({"unet.linear_1.lora_A.weight": torch.zeros(4, 32), "unet.linear_1.lora_B.weight": torch.zeros(128, 4)},
              str(unique))
    assert "time_embedding.linear_1" in load_lora_file(unique, targets, max_file_bytes=2**30).denoiser
    lora_format.check_lora_family(unique, targets, max_file_bytes=2**30)
    ambiguous = tmp_path / "ambiguous.safetensors"
    save_file({"unet.proj_in.lora_A.weight": torch.zeros(4, 32), "unet.proj_in.lora_B.weight": torch.zeros(32, 4)},
              str(ambiguous))
    with pytest.raises(LoRAFormatError, match="ambiguous"):
        load_lora_file(ambiguous, targets, max_file_bytes=2**30)
    with pytest.raises(LoRAFormatError, match="'proj_in' is ambiguous in this sd model"):
        lora_format.check_lora_family(ambiguous, targets, max_file_bytes=2**30)


def test_a_key_listed_over_the_limit_times_counts_each_time(targets, tmp_path):
    entry = '"unet.a.lora_A.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    header = ("{" + ", ".join([entry] * 5) + "}").encode()
    path = tmp_path / "repeated.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(LoRAFormatError, match="more than 4 tensors"):
        lora_format.check_lora_family(path, targets, max_file_bytes=2**30, max_tensors=4)


def _targets(preset: str) -> LoRATargets:
    components = build_preset(preset)
    return LoRATargets.from_modules(components.denoiser, components.text_encoder, components.text_encoder_2)
