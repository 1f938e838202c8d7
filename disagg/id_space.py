"""One int64 id space over a model's embedding tables, shared by deduplication, slicing and the cache.

Tables of one row width are adjacent, so a batch's unique ids of one width are one contiguous, sorted run whose rows
stack into one tensor: table ``t``'s row ``i`` is space id ``base[t] + i``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class IdGroup:
    """The tables of one row width, in space order; their ids are ``[start, stop)`` of the space."""

    dim: int
    tables: tuple[str, ...]
    start: int
    stop: int


@dataclass(frozen=True)
class IdSpace:
    """Every table's ids in one space: tables grouped by row width (widths in order of first appearance, tables in
    ``tables`` order within a width); ``base[t]`` is table ``t``'s first id."""

    groups: tuple[IdGroup, ...]
    base: Mapping[str, int]
    rows: Mapping[str, int]

    @classmethod
    def of(cls, tables: Mapping[str, tuple[int, int]]) -> IdSpace:
        """The space of ``{table: (rows, dim)}``."""
        if not tables:
            raise ValueError("an id space needs at least one table")
        base: dict[str, int] = {}
        groups = []
        end = 0
        for dim in dict.fromkeys(dim for _, dim in tables.values()):
            members = tuple(name for name, (_, width) in tables.items() if width == dim)
            start = end
            for name in members:
                base[name] = end
                end += tables[name][0]
            groups.append(IdGroup(dim, members, start, end))
        return cls(tuple(groups), base, {name: rows for name, (rows, _) in tables.items()})

    @property
    def tables(self) -> tuple[str, ...]:
        """Every table in space order."""
        return tuple(name for group in self.groups for name in group.tables)

    def bases(self, tables: tuple[str, ...]) -> torch.Tensor:
        """int64 [len(tables)]: the first id of each of ``tables``."""
        return torch.tensor([self.base[name] for name in tables], dtype=torch.int64)

    def bounds(self, tables: tuple[str, ...]) -> torch.Tensor:
        """int64 [len(tables) + 1]: where each of the adjacent ``tables`` starts in the space, then where the last
        ends."""
        return torch.tensor([*(self.base[name] for name in tables), self.base[tables[-1]] + self.rows[tables[-1]]],
                            dtype=torch.int64)


def stack_tables(model: nn.Module, space: IdSpace) -> dict[int, torch.Tensor]:
    """Moves ``model``'s tables (``space``'s, by module name) into one tensor per width, rows in space order, and
    makes each module's weight a view of it; returns them by width. Peak memory: the stack plus one table."""
    stacked = {}
    for group in space.groups:
        first = model.get_submodule(group.tables[0]).weight
        storage = torch.empty(group.stop - group.start, group.dim, dtype=first.dtype, device=first.device)
        for table in group.tables:
            module = model.get_submodule(table)
            start = space.base[table] - group.start
            view = storage[start:start + space.rows[table]]
            view.copy_(module.weight.detach())
            module.weight = nn.Parameter(view, requires_grad=module.weight.requires_grad)
        stacked[group.dim] = storage
    return stacked
