"""``autoconfig evaluate``: replay searchers on a profile bank and show how fast each finds the optimum.

Prints trials-to-optimum and trials-to-within-tolerance per searcher (median, p90, mean over held-out models
x seeds) and plots the mean best-so-far curve of each searcher (fraction of the optimum after each trial).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no display backend, no global figure state
from rich.table import Table

from autoconfig.replay import ReplayResult


def replay_table(result: ReplayResult) -> Table:
    """Trials to the optimum and to within the tolerance, per searcher."""
    within = f"to within {100 * result.tolerance:g}%"
    table = Table(title=f"replay: {len(result.models)} held-out models x {len(result.seeds)} seeds, "
                        f"spaces of {min(result.space_sizes)}-{max(result.space_sizes)} configurations")
    for column in ("searcher", f"{within}: median", "p90", "mean", "to optimum: median", "p90", "mean"):
        table.add_column(column)
    for name, report in result.searchers.items():
        stats = report.summary()
        table.add_row(name, *(f"{stats[f'{label}_{stat}']:.1f}" for label in ("within", "optimum")
                              for stat in ("median", "p90", "mean")))
    return table


def plot_progress(result: ReplayResult, path: str | Path, *, trials: int | None = None) -> Path:
    """PNG of each searcher's mean best-so-far (fraction of the optimum) against the trial count."""
    figure = Figure(figsize=(7, 4.5))
    axes = figure.subplots()
    for name, report in result.searchers.items():
        curve = report.best_so_far.reshape(-1, report.best_so_far.shape[-1]).mean(axis=0)
        shown = curve[:trials] if trials else curve
        axes.plot(np.arange(1, len(shown) + 1), shown, label=name)
    axes.axhline(1 - result.tolerance, color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("trials")
    axes.set_ylabel("best so far / optimum (mean)")
    axes.set_ylim(0, 1.02)
    axes.set_title(f"search progress, leave-one-model-out over {len(result.models)} models")
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


def selected(names: Sequence[str], known: Sequence[str]) -> list[str]:
    """``names`` validated against the known searchers, in the given order."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown searcher(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return list(names)
