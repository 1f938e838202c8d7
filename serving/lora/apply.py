"""Per-request LoRA application without touching base weights: one forward serves rows with different LoRAs,
scales, or none.

Unmerged when rows differ. A ``Linear`` whose rows use two or more LoRAs stacks each row's factors (kept while the
batch stays the same) and runs two batched matmuls per slot (a gather-BMM in the manner of Punica's BGMV, without
custom kernels), so the number of kernels does not grow with the number of LoRAs; ``Conv2d`` targets, and a single
LoRA on some rows, gather, run two small matmuls and scatter-add per LoRA. When every row has the same LoRAs, after
``merge_after`` forwards, a merged copy of each touched weight comes from a byte-bounded cache (dLoRA's switch between
merged and unmerged inference) that keeps the most used combinations. Base weights are never modified.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from serving.common.logging import get_logger
from serving.lora.weights import LoRALayer

logger = get_logger("serving.lora.apply")

LoRAPairs = tuple[tuple[Mapping[str, LoRALayer], float], ...]  # (layers, request scale) active on a row


@dataclass(frozen=True)
class LoRAGroup:
    """One LoRA's layers and the batch rows that use it, each row with its own strength."""

    layers: Mapping[str, LoRALayer]
    rows: torch.Tensor  # int64 [R] indices into the batch
    scales: torch.Tensor  # [R] request scale per row
    all_rows: bool  # rows == arange(batch): skip gather/scatter


@dataclass(frozen=True)
class LoRASlot:
    """The ``k``-th (layers, request scale) pair of every row (``None`` where a row has fewer than ``k + 1``)."""

    pairs: list[tuple[Mapping[str, LoRALayer], float] | None]

    @functools.cached_property
    def key(self) -> tuple:
        """What the slot's stacked factors depend on (computed once per plan, read by every hooked module)."""
        return tuple(None if pair is None else (id(pair[0]), pair[1]) for pair in self.pairs)


@dataclass(frozen=True)
class LoRAPlan:
    """What one forward applies: per-LoRA row groups, the same pairs as per-row slots (for stacked application),
    and the shared pairs when every row has the same."""

    groups: list[LoRAGroup]
    slots: list[LoRASlot]
    uniform: LoRAPairs | None


def plan_lora_rows(assignments: Sequence[Sequence[tuple[Mapping[str, LoRALayer], float]]],
                   device: torch.device) -> LoRAPlan | None:
    """``assignments[row]`` lists the (layers, scale) pairs active on that row; ``None`` when no row has any."""
    if not any(assignments):
        return None
    by_lora: dict[int, tuple[Mapping[str, LoRALayer], list[int], list[float]]] = {}
    for row, pairs in enumerate(assignments):
        for layers, scale in pairs:
            entry = by_lora.setdefault(id(layers), (layers, [], []))
            entry[1].append(row)
            entry[2].append(scale)
    total = len(assignments)
    groups = [
        LoRAGroup(
            layers=layers,
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            scales=torch.tensor(scales, dtype=torch.float32, device=device),
            all_rows=rows == list(range(total)),
        )
        for layers, rows, scales in by_lora.values()
    ]
    slots = [LoRASlot([tuple(pairs[k]) if len(pairs) > k else None for pairs in assignments])
             for k in range(max(len(pairs) for pairs in assignments))] if len(groups) > 1 else []
    first = _signature(assignments[0])
    uniform = tuple(assignments[0]) if all(_signature(pairs) == first for pairs in assignments) else None
    return LoRAPlan(groups, slots, uniform)


def _signature(pairs: Iterable[tuple[Mapping[str, LoRALayer], float]]) -> tuple[tuple[int, float], ...]:
    return tuple((id(layers), scale) for layers, scale in pairs)


def delta_weight(module: nn.Module, layer: LoRALayer) -> torch.Tensor:
    """``up @ down`` in the shape of ``module.weight`` (convolutions: a 1x1 ``up`` over a kxk ``down``)."""
    product = layer.up.flatten(1) @ layer.down.flatten(1)
    return product.view_as(module.weight)


def _delta(module: nn.Module, layer: LoRALayer, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, nn.Conv2d):
        hidden = F.conv2d(x, layer.down, stride=module.stride, padding=module.padding, dilation=module.dilation)
        return F.conv2d(hidden, layer.up)
    return F.linear(F.linear(x, layer.down), layer.up)


class _MergedWeights:
    """Byte-bounded cache of merged weight copies (``W + sum(scale * layer.scale * up @ down)``), per uniform LoRA
    combination, built module by module once the combination has run ``merge_after`` forwards unmerged. Room is
    taken from the least recently used combination only by one that ran more forwards lately (counts halve every
    ``RECENT_WINDOW`` forwards: TinyLFU's admission), so a rare combination runs unmerged rather than evict a
    frequent one, which would then be merged again."""

    RECENT_WINDOW = 256

    def __init__(self, budget_bytes: int, merge_after: int) -> None:
        self.budget_bytes = budget_bytes
        self.merge_after = merge_after
        self._entries: OrderedDict[tuple, tuple[LoRAPairs, dict[str, torch.Tensor]]] = OrderedDict()
        self._bytes = 0
        self._uses: OrderedDict[tuple, int] = OrderedDict()  # forwards run per combination (bounded)
        self._recent: dict[tuple, float] = {}  # forwards run per combination lately
        self._forwards = 0

    def count_use(self, pairs: LoRAPairs) -> None:
        key = _signature(pairs)
        self._uses[key] = self._uses.get(key, 0) + 1
        self._uses.move_to_end(key)
        while len(self._uses) > 1024:
            self._uses.popitem(last=False)
        self._recent[key] = self._recent.get(key, 0.0) + 1.0
        self._forwards += 1
        if self._forwards % self.RECENT_WINDOW == 0:
            self._recent = {key: uses / 2 for key, uses in self._recent.items() if uses >= 2}

    def weight(self, pairs: LoRAPairs, name: str, module: nn.Module) -> torch.Tensor | None:
        """The merged weight of ``module`` under ``pairs``; ``None``: not worth it yet, not touched, or no room."""
        key = _signature(pairs)
        if self._uses.get(key, 0) <= self.merge_after:
            return None
        touching = [(layers[name], scale) for layers, scale in pairs if name in layers]
        if not touching:
            return None
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            cached = entry[1].get(name)
            if cached is not None:
                return cached
        size = module.weight.numel() * module.weight.element_size()
        if size > self.budget_bytes:
            return None
        while self._bytes + size > self.budget_bytes and self._entries:
            oldest_key, (_, oldest) = next(iter(self._entries.items()))
            if oldest_key == key:
                return None  # the combination in use already fills the budget: leave this module unmerged
            if self._recent.get(oldest_key, 0.0) >= self._recent.get(key, 0.0):
                return None  # a combination used as much or more keeps its room
            self._entries.popitem(last=False)
            self._bytes -= sum(t.numel() * t.element_size() for t in oldest.values())
        merged = module.weight + sum(scale * layer.scale * delta_weight(module, layer) for layer, scale in touching)
        # The entry keeps ``pairs`` (and so the layer objects) alive: their ids in ``key`` cannot be reused.
        self._entries.setdefault(key, (pairs, {}))[1][name] = merged
        self._entries.move_to_end(key)
        self._bytes += size
        return merged


class _StackedFactors:
    """Per ``Linear`` and slot, the rows' LoRA factors stacked for batched matmuls: ``down`` scaled by each row's
    strength (zeros where a row has none, ranks padded to the largest), kept while the slot's rows stay the same
    (consecutive steps of one batch), so a forward runs two batched matmuls per slot and nothing else. Dropped
    when a forward needs none, so they never keep a LoRA alive past its batch."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], _Stacked] = {}  # (module, slot index) -> its stacked factors

    def add_delta(self, name: str, index: int, slot: LoRASlot, x: torch.Tensor,
                  output: torch.Tensor) -> torch.Tensor:
        """``output`` plus each row's ``strength * up @ down @ x`` for the slot's LoRA on ``name``."""
        entry = self._entries.get((name, index))
        if entry is None or entry.key != slot.key:
            entry = self._entries[(name, index)] = self._stack(name, slot, x.shape[-1], output.shape[-1])
        if entry.downs_t is None or entry.ups_t is None:  # no row's LoRA in this slot targets the module
            return output
        rows = x.shape[0]
        hidden = torch.bmm(x.reshape(rows, -1, x.shape[-1]), entry.downs_t)
        return torch.baddbmm(output.reshape(rows, -1, output.shape[-1]), hidden, entry.ups_t).view(output.shape)

    def clear(self) -> None:
        self._entries.clear()

    @staticmethod
    def _stack(name: str, slot: LoRASlot, in_features: int, out_features: int) -> _Stacked:
        layers = [pair[0].get(name) if pair is not None else None for pair in slot.pairs]
        present = [layer for layer in layers if layer is not None]
        if not present:
            return _Stacked(slot.key, slot.pairs, None, None)
        rank = max(layer.rank for layer in present)
        downs, ups = [], []
        for pair, layer in zip(slot.pairs, layers, strict=True):
            if layer is None:
                downs.append(present[0].down.new_zeros(rank, in_features))
                ups.append(present[0].up.new_zeros(out_features, rank))
                continue
            down, up, pad = layer.down * (pair[1] * layer.scale), layer.up, rank - layer.rank
            downs.append(F.pad(down, (0, 0, 0, pad)) if pad else down)
            ups.append(F.pad(up, (0, pad)) if pad else up)
        return _Stacked(slot.key, slot.pairs, torch.stack(downs).transpose(1, 2).contiguous(),
                        torch.stack(ups).transpose(1, 2).contiguous())


class _Stacked(NamedTuple):
    """One module's stacked factors for one slot: ``None`` when no row's LoRA in the slot targets the module."""

    key: tuple  # the slot's key when they were built
    pairs: list  # the slot's pairs, keeping the layer objects (whose ids are in ``key``) alive
    downs_t: torch.Tensor | None  # [rows, in, rank], each row's down scaled by its strength
    ups_t: torch.Tensor | None  # [rows, rank, out]


class LoRAHooks:
    """Per-row LoRA application on one model. ``merged_cache_bytes=0`` keeps every forward unmerged; ``"auto"``
    sizes the merged copies to the weights of every module a LoRA in use targets (so any one combination runs
    wholly merged), at most ``max_merged_bytes``.

    Targeted ``nn.Linear`` / ``nn.Conv2d`` modules get their ``forward`` wrapped on first use; outside
    :meth:`active` the wrapper calls the original forward directly.
    """

    def __init__(self, model: nn.Module, *, merged_cache_bytes: int | Literal["auto"] = 0, merge_after: int = 8,
                 max_merged_bytes: int | None = None) -> None:
        self._modules = dict(model.named_modules())
        self._wrapped: set[str] = set()
        self._plan: LoRAPlan | None = None
        self._auto = merged_cache_bytes == "auto"
        self._max_merged_bytes = max_merged_bytes
        self._targeted_bytes = 0  # weight bytes of the wrapped modules
        budget = 0 if self._auto else int(merged_cache_bytes)
        self._merged = _MergedWeights(budget, merge_after) if self._auto or budget > 0 else None
        self._stacked = _StackedFactors()

    @property
    def merged_budget_bytes(self) -> int:
        """Bytes the merged copies may hold now (``"auto"``: grows as LoRAs target more modules)."""
        return 0 if self._merged is None else self._merged.budget_bytes

    def ensure_hooks(self, module_names: Iterable[str]) -> None:
        """Wrap every named module not wrapped yet (names come from validated LoRA files)."""
        for name in module_names:
            if name in self._wrapped:
                continue
            module = self._modules[name]
            if not isinstance(module, nn.Linear | nn.Conv2d):
                raise TypeError(f"LoRA target {name} is a {type(module).__name__}, not Linear or Conv2d")
            module.forward = functools.partial(self._forward, name, module, module.forward)
            self._wrapped.add(name)
            self._targeted_bytes += module.weight.numel() * module.weight.element_size()
        if self._auto and self._merged is not None:
            wanted = self._targeted_bytes
            if self._max_merged_bytes is not None and wanted > self._max_merged_bytes:
                if self._merged.budget_bytes < self._max_merged_bytes:
                    logger.warning("merged LoRA weights capped at %s bytes of the %s the LoRAs in use target "
                                   "(lora.merged_cache_bytes: auto, bounded by free device memory): some modules "
                                   "of a combination run unmerged", f"{self._max_merged_bytes:,}", f"{wanted:,}")
                wanted = self._max_merged_bytes
            self._merged.budget_bytes = max(self._merged.budget_bytes, wanted)

    @contextmanager
    def active(self, plan: LoRAPlan | None) -> Iterator[None]:
        """Apply ``plan`` to every forward run inside the block (one model forward)."""
        if plan is not None and plan.uniform is not None and self._merged is not None:
            self._merged.count_use(plan.uniform)
        if plan is None or not plan.slots:
            self._stacked.clear()
        self._plan = plan
        try:
            yield
        finally:
            self._plan = None

    def _forward(self, name: str, module: nn.Module, base_forward: Callable[[torch.Tensor], torch.Tensor],
                 x: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            return base_forward(x)
        if plan.uniform is not None and self._merged is not None:
            weight = self._merged.weight(plan.uniform, name, module)
            if weight is not None:
                if isinstance(module, nn.Conv2d):
                    return module._conv_forward(x, weight, module.bias)
                return F.linear(x, weight, module.bias)
        output = base_forward(x)
        if plan.slots and isinstance(module, nn.Linear):
            for index, slot in enumerate(plan.slots):
                output = self._stacked.add_delta(name, index, slot, x, output)
            return output
        for group in plan.groups:
            layer = group.layers.get(name)
            if layer is None:
                continue
            shape = (-1,) + (1,) * (output.dim() - 1)
            strength = (group.scales * layer.scale).to(output.dtype).view(shape)
            if group.all_rows:
                output = output + _delta(module, layer, x) * strength
            else:
                rows_delta = _delta(module, layer, x.index_select(0, group.rows)) * strength
                output = output.index_add(0, group.rows, rows_delta)
        return output
