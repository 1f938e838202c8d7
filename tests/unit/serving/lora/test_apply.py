"""Per-row LoRA application on plain Linear / Conv2d modules, merged and unmerged."""

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from serving.lora.apply import LoRAHooks, delta_weight, plan_lora_rows
from serving.lora.weights import LoRALayer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)
        self.conv = nn.Conv2d(3, 4, kernel_size=3, padding=1)


def _layer(module: nn.Module, rank: int, seed: int, scale: float) -> LoRALayer:
    g = torch.Generator().manual_seed(seed)
    if isinstance(module, nn.Conv2d):
        down = torch.randn(rank, module.in_channels, *module.kernel_size, generator=g)
        up = torch.randn(module.out_channels, rank, 1, 1, generator=g)
    else:
        down = torch.randn(rank, module.in_features, generator=g)
        up = torch.randn(module.out_features, rank, generator=g)
    return LoRALayer(down=down, up=up, scale=scale)


def _expected(module: nn.Module, x: torch.Tensor, row_pairs) -> torch.Tensor:
    """Reference: each row through its own explicitly merged weight."""
    rows = []
    for row, pairs in enumerate(row_pairs):
        weight = module.weight.clone()
        for layers, scale in pairs:
            weight += scale * layers["m"].scale * delta_weight(module, layers["m"])
        conv = isinstance(module, nn.Conv2d)
        out = module._conv_forward(x[row:row + 1], weight, module.bias) if conv else nn.functional.linear(
            x[row:row + 1], weight, module.bias)
        rows.append(out)
    return torch.cat(rows)


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("merged_bytes", [0, 2**20])
def test_rows_get_their_own_loras_and_base_weights_stay(kind, merged_bytes):
    net = Net()
    module = getattr(net, kind)
    base = module.weight.clone()
    a, b = {"m": _layer(module, 2, 1, 0.5)}, {"m": _layer(module, 3, 2, 2.0)}
    hooks = LoRAHooks(nn.ModuleDict({"m": module}), merged_cache_bytes=merged_bytes, merge_after=1)
    hooks.ensure_hooks(["m"])
    x = torch.randn(4, 6) if kind == "linear" else torch.randn(4, 3, 5, 5)
    mixed = [[(a, 1.0)], [], [(a, -0.5), (b, 1.0)], [(b, 0.3)]]  # unmerged path
    uniform = [[(a, 0.7), (b, 1.0)]] * 4  # unmerged on first use, then merged when allowed
    for row_pairs in (mixed, uniform, uniform, uniform):
        plan = plan_lora_rows(row_pairs, torch.device("cpu"))
        with torch.inference_mode(), hooks.active(plan):
            out = module(x)
        torch.testing.assert_close(out, _expected(module, x, row_pairs), rtol=1e-4, atol=1e-4)
    assert torch.equal(module.weight, base)
    assert bool(hooks._merged and hooks._merged._entries) == (merged_bytes > 0)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), _expected(module, x, [[]] * 4))  # no plan: the base module


def test_uniform_plan_detection():
    layers = {"m": _layer(nn.Linear(2, 2), 1, 0, 1.0)}
    cpu = torch.device("cpu")
    assert plan_lora_rows([[], []], cpu) is None
    assert plan_lora_rows([[(layers, 1.0)]] * 3, cpu).uniform == ((layers, 1.0),)
    assert plan_lora_rows([[(layers, 1.0)], [(layers, 0.5)]], cpu).uniform is None
    assert plan_lora_rows([[(layers, 1.0)], []], cpu).uniform is None


def test_merged_copies_respect_the_byte_budget():
    module = nn.Linear(64, 64)  # 16 KiB of fp32 weight
    hooks = LoRAHooks(nn.ModuleDict({"m": module}), merged_cache_bytes=20 * 2**10, merge_after=0)
    hooks.ensure_hooks(["m"])
    x = torch.randn(2, 64)
    combos = [{"m": _layer(module, 4, seed, 1.0)} for seed in range(3)]
    for layers in combos:
        with torch.inference_mode(), hooks.active(plan_lora_rows([[(layers, 1.0)]] * 2, torch.device("cpu"))):
            torch.testing.assert_close(module(x), _expected(module, x, [[(layers, 1.0)]] * 2), rtol=1e-4, atol=1e-4)
    assert len(hooks._merged._entries) == 1 and hooks._merged._bytes == 16 * 2**10


def test_a_rarer_combination_runs_unmerged_rather_than_evict_a_frequent_one():
    """Room for one combination (``auto`` on a LoRA's modules): a warm LoRA used often keeps its merged copy (the
    same tensor, not merged again) while a two-LoRA combination used less, past ``merge_after``, runs unmerged and
    exact; once the two-LoRA one has run more forwards lately, it takes the room."""
    module = nn.Linear(64, 64)  # 16 KiB of fp32 weight
    hooks = LoRAHooks(nn.ModuleDict({"m": module}), merged_cache_bytes="auto", merge_after=2,
                      max_merged_bytes=2**30)
    hooks.ensure_hooks(["m"])
    warm, other = {"m": _layer(module, 4, 0, 1.0)}, {"m": _layer(module, 4, 1, 1.0)}
    single, double = [[(warm, 1.0)]] * 2, [[(warm, 1.0), (other, 0.5)]] * 2
    x = torch.randn(2, 64)

    def run(rows: list, times: int) -> None:
        for _ in range(times):
            with torch.inference_mode(), hooks.active(plan_lora_rows(rows, torch.device("cpu"))):
                torch.testing.assert_close(module(x), _expected(module, x, rows), rtol=1e-4, atol=1e-4)

    def merged() -> list[tuple[int, torch.Tensor]]:  # (LoRAs, merged weight) per cached combination
        return [(len(pairs), weights["m"]) for pairs, weights in hooks._merged._entries.values()]

    run(single, 8)
    ((loras, copy),) = merged()
    assert loras == 1
    run(double, 4)  # past merge_after, fewer forwards than the warm LoRA's 8
    assert [loras for loras, _ in merged()] == [1] and merged()[0][1] is copy
    run(single, 1)
    assert merged()[0][1] is copy
    run(double, 6)  # 10 forwards lately against 9
    assert [loras for loras, _ in merged()] == [2]


def test_auto_budget_grows_with_the_targeted_weights_within_its_cap(all_logs):
    net = nn.ModuleDict({"a": nn.Linear(64, 64), "b": nn.Linear(64, 32), "c": nn.Linear(32, 32)})  # 16, 8, 4 KiB
    hooks = LoRAHooks(net, merged_cache_bytes="auto", merge_after=0, max_merged_bytes=20 * 2**10)
    assert hooks.merged_budget_bytes == 0
    hooks.ensure_hooks(["a"])
    assert hooks.merged_budget_bytes == 16 * 2**10
    hooks.ensure_hooks(["a", "b"])  # 24 KiB targeted: the cap binds, once said
    hooks.ensure_hooks(["c"])
    assert hooks.merged_budget_bytes == 20 * 2**10
    capped = [record for record in all_logs.records if "capped" in record.getMessage()]
    assert [record.levelname for record in capped] == ["WARNING"]
    assert LoRAHooks(net, merged_cache_bytes=0).merged_budget_bytes == 0


def _unmerged_modules(hooks: LoRAHooks, model: nn.Module, names: list[str], layers: dict[str, LoRALayer]) -> int:
    """Modules of a warm single-LoRA combination that would run unmerged (``merge_after=0``: warm at once)."""
    hooks.ensure_hooks(names)
    pairs = ((layers, 1.0),)
    hooks._merged.count_use(pairs)
    return sum(hooks._merged.weight(pairs, name, model.get_submodule(name)) is None for name in names)


def test_auto_leaves_no_module_of_a_warm_attention_lora_unmerged_on_sdxl_shape():
    """The GPU figure behind it: an attention LoRA on SDXL touches 1.78 GiB of fp16 weights, and the former fixed
    1 GiB left most of its modules unmerged every step."""
    from benchmarks.common import ATTENTION_PROJECTIONS
    from serving.presets import sdxl_shape_unet

    with torch.device("meta"):
        unet = sdxl_shape_unet().to(torch.float16)
    names = [name for name, module in unet.named_modules()
             if name.endswith(ATTENTION_PROJECTIONS) and isinstance(module, nn.Linear)]
    layers = {name: LoRALayer(down=torch.empty(8, unet.get_submodule(name).in_features, device="meta",
                                               dtype=torch.float16),
                              up=torch.empty(unet.get_submodule(name).out_features, 8, device="meta",
                                             dtype=torch.float16), scale=1.0) for name in names}
    targeted = sum(unet.get_submodule(name).weight.nbytes for name in names)
    assert len(names) == 560 and 1.7 * 2**30 < targeted < 1.8 * 2**30
    auto = LoRAHooks(unet, merged_cache_bytes="auto", merge_after=0, max_merged_bytes=64 * 2**30)
    assert _unmerged_modules(auto, unet, names, layers) == 0 and auto.merged_budget_bytes == targeted
    fixed = LoRAHooks(unet, merged_cache_bytes=2**30, merge_after=0)
    assert _unmerged_modules(fixed, unet, names, layers) > len(names) // 3


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_for_one_lora_per_row(rows: int) -> int:
    """Aten ops in the second of two forwards (a new plan each, as each step builds one) with one LoRA per row."""
    module = nn.Linear(16, 8)
    hooks = LoRAHooks(nn.ModuleDict({"m": module}))
    hooks.ensure_hooks(["m"])
    x = torch.randn(rows, 5, 16)
    row_pairs = [[({"m": _layer(module, 4, seed, 1.0)}, 1.0)] for seed in range(rows)]
    expected = torch.stack([_expected(module, x[row], [row_pairs[row]] * 5) for row in range(rows)])
    counter = _CountOps()
    for step in range(2):
        plan = plan_lora_rows(row_pairs, torch.device("cpu"))
        with torch.inference_mode(), hooks.active(plan), counter if step == 1 else contextlib.nullcontext():
            out = module(x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    return counter.ops


def test_a_linear_runs_as_many_kernels_for_eight_loras_as_for_two():
    """Rows with different LoRAs run as batched matmuls over stacked factors, kept from one step to the next: a
    step's op count does not grow with the number of LoRAs."""
    assert _ops_for_one_lora_per_row(8) == _ops_for_one_lora_per_row(2)


def test_stacked_factors_follow_each_change_of_the_batch():
    """Kept factors are rebuilt when a row's LoRA or scale changes, and reused when the same rows come back."""
    module = nn.Linear(6, 5)
    hooks = LoRAHooks(nn.ModuleDict({"m": module}))
    hooks.ensure_hooks(["m"])
    a, b, c = ({"m": _layer(module, rank, seed, 0.5)} for rank, seed in ((2, 1), (3, 2), (2, 3)))
    x = torch.randn(3, 6)
    batches = [
        [[(a, 1.0)], [(b, 1.0)], []],
        [[(a, 1.0)], [(c, 1.0)], []],  # another LoRA on row 1
        [[(a, 0.4)], [(c, 1.0)], []],  # another scale on row 0
        [[(a, 0.4)], [(c, 1.0)], [(b, 2.0), (a, 1.0)]],  # a second slot appears
        [[(a, 1.0)], [(b, 1.0)], []],  # the first batch again
    ]
    for row_pairs in batches:
        with torch.inference_mode(), hooks.active(plan_lora_rows(row_pairs, torch.device("cpu"))):
            out = module(x)
        torch.testing.assert_close(out, _expected(module, x, row_pairs), rtol=1e-4, atol=1e-4)


def test_stacked_factors_do_not_keep_a_lora_alive_after_its_batch():
    module = nn.Linear(6, 5)
    hooks = LoRAHooks(nn.ModuleDict({"m": module}))
    hooks.ensure_hooks(["m"])
    a, b = {"m": _layer(module, 2, 1, 1.0)}, {"m": _layer(module, 2, 2, 1.0)}
    gone = weakref.ref(a["m"])
    x = torch.randn(2, 6)
    for row_pairs in ([[(a, 1.0)], [(b, 1.0)]], [[], []]):  # a mixed batch, then one without LoRAs
        with torch.inference_mode(), hooks.active(plan_lora_rows(row_pairs, torch.device("cpu"))):
            module(x)
    del a
    gc.collect()
    assert gone() is None
