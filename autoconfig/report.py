"""``autoconfig report``: what a study (or a profile-bank entry) measured, as a table and one PNG.

The PNG has three panels: the search progress (each trial's objective in order, and the best so far), the
performance surface (``performance_surface``) and the trade-off of objective and p99 with its Pareto front.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from autoconfig.pareto import pareto_front
from autoconfig.searchers.base import Observation
from autoconfig.space import SearchSpace


@dataclass(frozen=True)
class Surface:
    """Best objective per row (a combination of ``row_knobs``' values) and column (a value of ``column_knob``);
    NaN where unobserved."""

    column_knob: str
    row_knobs: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]
    columns: tuple[object, ...]
    values: np.ndarray


def surface_axes(space: SearchSpace) -> tuple[str, tuple[str, ...]]:
    """The surface's column knob and row knobs. With the shortcuts: batch size by device share x replicas (the
    cells take the best over the other knobs). Otherwise the knob with the most values by the others, but for the
    one with the most values when three or more remain."""
    names = space.knob_names
    if space.has_shortcuts:
        return "max_batch_size", ("device_share", "num_replicas")
    column = max(names, key=lambda n: len(space.values(n)))
    rest = [name for name in names if name != column]
    if len(rest) >= 3:
        rest.remove(max(rest, key=lambda n: len(space.values(n))))
    return column, tuple(rest)


def performance_surface(space: SearchSpace, history: Sequence[Observation]) -> Surface:
    """The surface of ``history`` over ``space`` (:func:`surface_axes`): each cell the best objective over the
    knobs left out; NaN where no trial ran, 0 where every trial failed or missed the SLO."""
    column_knob, row_knobs = surface_axes(space)
    rows = tuple(sorted({tuple(c[name] for name in row_knobs) for c in space.configurations()},
                        key=lambda row: [space.values(name).index(v) for name, v in zip(row_knobs, row, strict=True)]))
    columns = space.values(column_knob)
    values = np.full((len(rows), len(columns)), np.nan)
    for observation in history:
        config = observation.config
        i, j = rows.index(tuple(config[name] for name in row_knobs)), columns.index(config[column_knob])
        value = observation.value or 0.0
        values[i, j] = value if np.isnan(values[i, j]) else max(values[i, j], value)
    return Surface(column_knob, row_knobs, rows, columns, values)


def best_so_far(history: Sequence[Observation]) -> np.ndarray:
    """Running maximum of the objective (a failed trial counts 0)."""
    return np.maximum.accumulate(np.array([o.value or 0.0 for o in history], dtype=np.float64))


def plot_report(space: SearchSpace, history: Sequence[Observation], path: str | Path, *, title: str,
                objective: str, records: Sequence[Mapping[str, Any]] = ()) -> Path:
    """Write the PNG (progress, surface, and the front of ``records``, the trials' measurements) to ``path``."""
    if not history:
        raise ValueError("nothing to plot: no finished trial")
    figure = Figure(figsize=(17, 4.8))
    progress, heat, trade_off = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1.2, 1]})
    trials = np.arange(1, len(history) + 1)
    progress.scatter(trials, [o.value or 0.0 for o in history], s=12, color="tab:blue", label="trial")
    progress.step(trials, best_so_far(history), where="post", color="tab:red", label="best so far")
    progress.set_xlabel("trial")
    progress.set_ylabel(objective)
    progress.set_title("search progress")
    progress.legend(loc="lower right")

    surface = performance_surface(space, history)
    image = heat.imshow(np.ma.masked_invalid(surface.values), aspect="auto", cmap="viridis")
    heat.set_xticks(range(len(surface.columns)), [str(c) for c in surface.columns])
    heat.set_yticks(range(len(surface.rows)), [" x ".join(map(str, row)) for row in surface.rows])
    heat.set_xlabel(surface.column_knob)
    heat.set_ylabel(" x ".join(surface.row_knobs) or "-")
    heat.set_title("performance surface (best over the other knobs)")
    for (i, j), value in np.ndenumerate(surface.values):
        if np.isfinite(value):
            heat.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7, color="white")
    figure.colorbar(image, ax=heat, label=objective)
    _plot_front(trade_off, records, objective)
    figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    return path


def _plot_front(axes: Any, records: Sequence[Mapping[str, Any]], objective: str) -> None:
    """Objective against p99 of the ok trials, the Pareto front (objective up, p99 and memory down) joined."""
    ok = [record for record in records if record.get("status") == "ok" and record.get("p99_ms") is not None]
    axes.scatter([r["p99_ms"] for r in ok], [r["objective"] for r in ok], s=12, color="tab:blue", label="ok trial")
    front = sorted((records[i] for i in pareto_front(records) if records[i].get("p99_ms") is not None),
                   key=lambda record: record["p99_ms"])
    axes.plot([r["p99_ms"] for r in front], [r["objective"] for r in front], "o-", color="tab:red", label="front")
    axes.set_xlabel("p99 latency at that rate (ms)")
    axes.set_ylabel(objective)
    axes.set_title("trade-off and Pareto front")
    if ok:
        axes.legend(loc="lower right")
