"""Unmerged, per-row LoRA application: one forward serves rows with different LoRAs, scales, or none.

Forward hooks on the targeted ``nn.Linear`` / ``nn.Conv2d`` modules add, for each LoRA active in the
batch, ``scale_row * layer.scale * up(down(x_rows))`` to the rows that use it (gather, two small
matmuls, scatter-add: the Punica/S-LoRA idea without custom kernels). Base weights are only read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving.lora.weights import LoRALayer


@dataclass(frozen=True)
class LoRAGroup:
    """One LoRA's layers and the batch rows that use it, each row with its own strength."""

    layers: Mapping[str, LoRALayer]
    rows: torch.Tensor  # int64 [R] indices into the batch
    scales: torch.Tensor  # [R] request scale per row
    all_rows: bool  # rows == arange(batch): skip gather/scatter


def plan_groups(
    assignments: Sequence[Sequence[tuple[Mapping[str, LoRALayer], float]]], device: torch.device
) -> list[LoRAGroup]:
    """Group batch rows by LoRA. ``assignments[row]`` lists the (layers, scale) pairs active on that row."""
    by_lora: dict[int, tuple[Mapping[str, LoRALayer], list[int], list[float]]] = {}
    for row, pairs in enumerate(assignments):
        for layers, scale in pairs:
            entry = by_lora.setdefault(id(layers), (layers, [], []))
            entry[1].append(row)
            entry[2].append(scale)
    total = len(assignments)
    return [
        LoRAGroup(
            layers=layers,
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            scales=torch.tensor(scales, dtype=torch.float32, device=device),
            all_rows=rows == list(range(total)),
        )
        for layers, rows, scales in by_lora.values()
    ]


def _delta(module: nn.Module, layer: LoRALayer, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, nn.Conv2d):
        hidden = F.conv2d(x, layer.down, stride=module.stride, padding=module.padding, dilation=module.dilation)
        return F.conv2d(hidden, layer.up)
    return F.linear(F.linear(x, layer.down), layer.up)


class LoRAHooks:
    """Per-row LoRA deltas on one model. Hooks are added on first use of a module and stay (cheap when idle)."""

    def __init__(self, model: nn.Module) -> None:
        self._modules = dict(model.named_modules())
        self._hooked: set[str] = set()
        self._groups: list[LoRAGroup] = []

    def ensure_hooks(self, module_names: Iterable[str]) -> None:
        """Hook every named module not hooked yet (names come from validated LoRA files)."""
        for name in module_names:
            if name in self._hooked:
                continue
            module = self._modules[name]
            if not isinstance(module, nn.Linear | nn.Conv2d):
                raise TypeError(f"LoRA target {name} is a {type(module).__name__}, not Linear or Conv2d")
            module.register_forward_hook(self._make_hook(name))
            self._hooked.add(name)

    @contextmanager
    def active(self, groups: list[LoRAGroup]) -> Iterator[None]:
        """Apply ``groups`` to every forward run inside the block."""
        self._groups = groups
        try:
            yield
        finally:
            self._groups = []

    def _make_hook(self, name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
            if not self._groups:
                return None
            x = args[0]
            for group in self._groups:
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

        return hook
