"""SD3 ControlNets: the preset, loading from a directory, and the runner against a direct ``SD3ControlNetModel``
forward with ``StableDiffusion3ControlNetPipeline``'s argument choices."""

import copy
import json

import pytest
import torch
from diffusers import SD3ControlNetModel

from serving.controlnet.models import CONTROLNET_PRESETS, build_controlnet_preset, load_controlnet
from serving.controlnet.runner import ControlNetCall, ControlNetRunner, merge_calls, split_residuals
from serving.presets import build_preset

CPU = torch.device("cpu")
SHIFT, SCALING = 0.0609, 1.5305  # sd3-tiny's VAE shift_factor and scaling_factor
ROWS, TEXT_TOKENS = 3, 10


@pytest.fixture(scope="module")
def transformer():
    return build_preset("sd3-tiny", weights="seeded").denoiser


@pytest.fixture(scope="module")
def controlnet(transformer) -> SD3ControlNetModel:
    return build_controlnet_preset("sd3-tiny", seed=1, denoiser=transformer)


def _with_config(model: SD3ControlNetModel, **changes) -> SD3ControlNetModel:
    """``model``'s weights under its config with ``changes``."""
    changed = SD3ControlNetModel.from_config({**model.config, **changes})
    changed.load_state_dict(model.state_dict())
    return changed.eval()


def _without_text_embedder(seed: int) -> SD3ControlNetModel:
    """A ControlNet of single-stream blocks (``joint_attention_dim`` None, as SD3.5 8B's) that must not be given
    text embeddings; its zero-initialised layers drawn non-zero."""
    torch.manual_seed(seed)
    model = SD3ControlNetModel(sample_size=16, patch_size=2, in_channels=16, num_layers=1, attention_head_dim=8,
                               num_attention_heads=4, joint_attention_dim=None, caption_projection_dim=32,
                               pooled_projection_dim=64, out_channels=16, pos_embed_max_size=32,
                               force_zeros_for_pooled_projection=False)
    for layer in [*model.controlnet_blocks, model.pos_embed_input.proj]:
        torch.nn.init.normal_(layer.weight, std=0.05)
        torch.nn.init.normal_(layer.bias, std=0.05)
    return model.eval()


def _call(seed: int, rows: int = ROWS) -> tuple[ControlNetCall, torch.Tensor]:
    """An engine's call of ``rows`` rows (two control latents: the first covers all but the last row) and the
    VAE modes of its control images [rows, 16, 16, 16], one per row, as the pipeline encodes them."""
    generator = torch.Generator().manual_seed(seed)
    modes = [torch.randn(1, 16, 16, 16, generator=generator) for _ in range(2)]
    context = torch.randn(rows, TEXT_TOKENS, 64, generator=generator)
    call = ControlNetCall(
        sample=torch.randn(rows, 16, 16, 16, generator=generator),
        timestep=torch.rand(rows, generator=generator) * 1000,
        encoder_hidden_states=context,
        context_rows=[(context, row) for row in range(rows)],
        scales=torch.linspace(0.5, 1.5, rows),
        images=[((modes[0] - SHIFT) * SCALING, rows - 1), ((modes[1] - SHIFT) * SCALING, 1)],
        added={"pooled_projections": torch.randn(rows, 64, generator=generator)},
        latent_shift=SHIFT * SCALING,
    )
    return call, torch.cat([modes[0].expand(rows - 1, -1, -1, -1), modes[1]])


def _pipeline_forward(model: SD3ControlNetModel, call: ControlNetCall, modes: torch.Tensor, *,
                      zero_pooled: bool, vae_shift: float, with_text: bool) -> list[torch.Tensor]:
    """Each row through ``model`` on its own, as the pipeline calls it (its scale as ``conditioning_scale``), the
    block samples stacked over the rows."""
    pooled = call.added["pooled_projections"]
    rows = []
    with torch.inference_mode():
        for row in range(call.rows):
            (blocks,) = model(
                hidden_states=call.sample[row:row + 1],
                controlnet_cond=(modes[row:row + 1] - vae_shift) * SCALING,
                conditioning_scale=float(call.scales[row]),
                encoder_hidden_states=call.encoder_hidden_states[row:row + 1] if with_text else None,
                pooled_projections=torch.zeros_like(pooled[row:row + 1]) if zero_pooled else pooled[row:row + 1],
                timestep=call.timestep[row:row + 1],
                return_dict=False,
            )
            rows.append(blocks)
    return [torch.cat(samples) for samples in zip(*rows, strict=True)]


def _pipeline_choices(model: SD3ControlNetModel) -> dict:
    instantx = model.config.force_zeros_for_pooled_projection
    return {"zero_pooled": instantx, "vae_shift": 0.0 if instantx else SHIFT,
            "with_text": model.config.joint_attention_dim is not None}


@pytest.mark.parametrize("kind", ["instantx", "shifted", "no-text"])
def test_the_runner_runs_an_sd3_controlnet_as_the_pipeline_does(controlnet, kind):
    """InstantX style (force_zeros_for_pooled_projection): zero pooled projections, latents without the VAE shift;
    otherwise the rows' pooled projections and shifted latents; text embeddings only with a context embedder. Each
    row scaled by its own scale; another argument choice gives other residuals."""
    model = {"instantx": lambda: controlnet,
             "shifted": lambda: _with_config(controlnet, force_zeros_for_pooled_projection=False),
             "no-text": lambda: _without_text_embedder(seed=4)}[kind]()
    call, modes = _call(seed=2)
    residuals = ControlNetRunner(model, CPU).run(call)
    choices = _pipeline_choices(model)
    expected = _pipeline_forward(model, call, modes, **choices)

    assert residuals.mid is None and len(residuals.down) == len(expected) == 1
    assert residuals.down[0].shape == (ROWS, 64, 32)  # rows, 8 x 8 patches, the transformer's width
    for ours, reference in zip(residuals.down, expected, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for wrong in ({"zero_pooled": not choices["zero_pooled"]}, {"vae_shift": SHIFT - choices["vae_shift"]}):
        other = _pipeline_forward(model, call, modes, **choices | wrong)
        assert (other[0] - residuals.down[0]).abs().max() > 1e-4


def test_sd3_calls_merge_and_their_residuals_split_back_without_a_mid_residual(controlnet):
    runner = ControlNetRunner(controlnet, CPU)
    calls = [_call(seed=5, rows=2)[0], _call(seed=6, rows=3)[0]]
    merged = merge_calls(calls)
    assert merged.rows == 5 and merged.latent_shift == calls[0].latent_shift and len(merged.images) == 4
    parts = split_residuals(runner.run(merged), [call.rows for call in calls])
    for part, call in zip(parts, calls, strict=True):
        alone = runner.run(call)
        assert part.mid is None and all(block.is_contiguous() for block in part.down)
        for ours, expected in zip(part.down, alone.down, strict=True):
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_calls_with_different_latent_shifts_do_not_merge():
    calls = [_call(seed=5, rows=2)[0], _call(seed=6, rows=2)[0]]
    calls[1].latent_shift = 0.0
    with pytest.raises(ValueError, match="latent shifts"):
        merge_calls(calls)


def test_the_sd3_preset_is_deterministic_and_copies_the_transformer(transformer):
    """Same seed, same weights; another seed, other ControlNet layers; ``zero_init`` is exactly diffusers'
    ``from_transformer`` (zero ControlNet blocks and input embedding), and leaves the transformer's config alone."""
    assert "sd3-tiny" in CONTROLNET_PRESETS
    config = dict(transformer.config)
    first, again = (build_controlnet_preset("sd3-tiny", seed=7, denoiser=transformer).state_dict() for _ in range(2))
    other = build_controlnet_preset("sd3-tiny", seed=8, denoiser=transformer).state_dict()
    assert first.keys() == again.keys() and all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["controlnet_blocks.0.weight"], other["controlnet_blocks.0.weight"])
    assert first["pos_embed_input.proj.weight"].abs().min() > 0
    assert torch.equal(first["transformer_blocks.0.attn.to_q.weight"],
                       transformer.state_dict()["transformer_blocks.0.attn.to_q.weight"])

    zero = build_controlnet_preset("sd3-tiny", seed=7, zero_init=True, denoiser=transformer)
    reference = SD3ControlNetModel.from_transformer(copy.deepcopy(transformer), num_layers=1,
                                                    num_extra_conditioning_channels=0)
    assert dict(zero.config) == dict(reference.config) and zero.config.num_layers == 1
    zero_state, reference_state = zero.state_dict(), reference.state_dict()
    assert all(torch.equal(zero_state[key], reference_state[key]) for key in reference_state)
    assert all(zero_state[key].count_nonzero() == 0 for key in zero_state
               if key.startswith(("controlnet_blocks.", "pos_embed_input.")))
    assert dict(transformer.config) == config


def test_the_sd3_preset_defaults_to_its_seeded_transformer_and_refuses_a_unet(transformer):
    built = build_controlnet_preset("sd3-tiny", seed=7).state_dict()
    given = build_controlnet_preset("sd3-tiny", seed=7, denoiser=transformer).state_dict()
    assert all(torch.equal(built[key], given[key]) for key in given)
    with pytest.raises(ValueError, match="SD3Transformer2DModel"):
        build_controlnet_preset("sd3-tiny", denoiser=build_preset("tiny").denoiser)
    with pytest.raises(ValueError, match="UNet2DConditionModel"):
        build_controlnet_preset("tiny", denoiser=transformer)


def test_an_sd3_controlnet_directory_loads_back_as_saved(controlnet, tmp_path):
    controlnet.save_pretrained(tmp_path / "sd3", safe_serialization=True)
    loaded = load_controlnet(tmp_path / "sd3")
    assert type(loaded) is SD3ControlNetModel and not loaded.training
    assert _public(loaded.config) == _public(controlnet.config)
    expected = controlnet.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())


def _public(config) -> dict:
    """A config's architecture, as its config.json holds it."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in config.items()
            if not key.startswith("_")}


@pytest.mark.parametrize(("changes", "message"), [
    ({"_class_name": "SparseControlNetModel"},
     r"'SparseControlNetModel'.*ControlNetModel, SD3ControlNetModel, FluxControlNetModel"),
    ({"_class_name": "FluxControlNetModel", "num_mode": 10}, "Flux ControlNets with modes"),
    ({"_class_name": "FluxControlNetModel", "conditioning_embedding_channels": 16}, "an image hint block"),
    ({"use_pos_embed": False}, "positional embedding"),
    ({"extra_conditioning_channels": 1}, "extra conditioning channels"),
])
def test_unserved_controlnet_directories_are_refused_before_loading(controlnet, tmp_path, changes, message):
    controlnet.save_pretrained(tmp_path / "net", safe_serialization=True)
    config_path = tmp_path / "net" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | changes))
    (tmp_path / "net" / "diffusion_pytorch_model.safetensors").unlink()  # refused before any weights are looked for
    with pytest.raises(ValueError, match=message):
        load_controlnet(tmp_path / "net")
