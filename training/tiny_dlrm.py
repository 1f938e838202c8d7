"""Training a DLRM preset on synthetic click logs (``training.click_logs``) and shipping its weights.

The model is the preset's exact architecture, so serving loads the weights by module name. Seeded, on the CPU:
Adam on binary cross-entropy over a fixed training set (stream 0), scored on stream 1 against the generator's
Bayes-optimal AUC. One epoch by default: at equal steps, one pass over more rows beats two over fewer (the
second pass memorises the labels' noise).
``python -m training.tiny_dlrm`` writes ``disagg/weights/tiny/model.safetensors`` and ``model.json``.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from disagg.model import DLRM, build_preset
from disagg.spec import preset_weights
from training.click_logs import ClickBatch, ClickLogs, roc_auc

TRAIN_STREAM = 0
HELDOUT_STREAM = 1
FORMAT = "swiftserve-dlrm-weights/1"


@dataclass(frozen=True)
class TrainingSettings:
    """What a training run does; recorded beside the weights."""

    preset: str = "tiny"
    data_seed: int = 0  # the click-log generator's seed: ground truth and feature distribution
    init_seed: int = 0  # the model's initialisation and the order of the training rows
    train_rows: int = 655_360
    heldout_rows: int = 131_072
    epochs: int = 1
    batch_size: int = 1024
    learning_rate: float = 2e-3
    target_ctr: float = 0.15

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.train_rows // self.batch_size)


@dataclass(frozen=True)
class TrainingReport:
    """Outcome of a run: held-out AUC of the model and of the ground truth on the same labels, and costs."""

    settings: TrainingSettings
    steps: int
    wall_seconds: float
    cpu_seconds: float
    torch_threads: int
    final_train_loss: float
    heldout_auc: float
    best_achievable_auc: float  # AUC of the true click probability on the held-out labels
    heldout_log_loss: float
    best_achievable_log_loss: float
    heldout_ctr: float

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self), "torch": torch.__version__,
                "python": platform.python_version()}


def train(
    model: DLRM,
    data: ClickBatch,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[int, float]:
    """Trains ``model`` in place on ``data`` (BCE, Adam): ``epochs`` passes in a seeded order.

    ``on_step(step, loss)`` is called after every step; returns the steps taken and the mean loss of the last epoch.
    """
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    order = torch.Generator().manual_seed(seed)
    model.train()
    step, last_epoch_loss = 0, float("nan")
    for _ in range(epochs):
        permutation = torch.randperm(len(data), generator=order)
        total, batches = 0.0, 0
        for start in range(0, len(data), batch_size):
            rows = permutation[start : start + batch_size]
            probabilities = model(data.dense[rows], data.sparse[rows]).squeeze(1)
            loss = F.binary_cross_entropy(probabilities, data.labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            total, batches = total + loss.item(), batches + 1
            if on_step is not None:
                on_step(step, loss.item())
        last_epoch_loss = total / batches
    model.eval()
    return step, last_epoch_loss


@torch.inference_mode()
def predict(model: DLRM, dense: torch.Tensor, sparse: torch.Tensor, rows_per_forward: int = 16_384) -> torch.Tensor:
    """Click probabilities float32 [rows] of ``model`` in eval mode, in chunks."""
    model.eval()
    return torch.cat([
        model(dense[start : start + rows_per_forward], sparse[start : start + rows_per_forward]).squeeze(1)
        for start in range(0, dense.shape[0], rows_per_forward)
    ])


def log_loss(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of ``probabilities`` on ``labels``."""
    p = probabilities.double().clamp(1e-7, 1 - 1e-7)
    return F.binary_cross_entropy(p, labels.double()).item()


def train_preset(
    settings: TrainingSettings, on_step: Callable[[int, float], None] | None = None
) -> tuple[DLRM, TrainingReport]:
    """Draws the click logs, trains preset ``settings.preset`` from its seeded initialisation and scores it."""
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(settings.init_seed)
    model = build_preset(settings.preset, seed=settings.init_seed)
    options = {"seed": settings.data_seed, "target_ctr": settings.target_ctr}
    train_data = ClickLogs(model.spec, stream=TRAIN_STREAM, **options).batch(settings.train_rows)
    heldout = ClickLogs(model.spec, stream=HELDOUT_STREAM, **options).batch(settings.heldout_rows)
    steps, train_loss = train(model, train_data, epochs=settings.epochs, batch_size=settings.batch_size,
                              learning_rate=settings.learning_rate, seed=settings.init_seed, on_step=on_step)
    scores = predict(model, heldout.dense, heldout.sparse)
    report = TrainingReport(
        settings=settings,
        steps=steps,
        wall_seconds=round(time.perf_counter() - started_wall, 2),
        cpu_seconds=round(time.process_time() - started_cpu, 2),
        torch_threads=torch.get_num_threads(),
        final_train_loss=round(train_loss, 5),
        heldout_auc=round(roc_auc(scores, heldout.labels), 5),
        best_achievable_auc=round(roc_auc(heldout.probability, heldout.labels), 5),
        heldout_log_loss=round(log_loss(scores, heldout.labels), 5),
        best_achievable_log_loss=round(log_loss(heldout.probability, heldout.labels), 5),
        heldout_ctr=round(heldout.labels.mean().item(), 5),
    )
    return model, report


def save(model: DLRM, report: TrainingReport, weights: Path) -> Path:
    """Writes ``model``'s state dict to the safetensors file ``weights`` and the report beside it (``.json``)."""
    weights.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, weights, metadata={"format": FORMAT, "preset": report.settings.preset,
                                          "data_seed": str(report.settings.data_seed)})
    report_path = weights.with_suffix(".json")
    report_path.write_text(json.dumps(report.as_json(), indent=2) + "\n")
    return report_path


def shipped_report(preset: str = "tiny") -> dict[str, Any]:
    """The JSON written beside a preset's shipped weights (settings, steps, time, AUCs)."""
    weights = preset_weights(preset)
    if weights is None:
        raise ValueError(f"DLRM preset {preset!r} ships no trained weights")
    return json.loads(weights.with_suffix(".json").read_text())


def _check_finite(model: DLRM) -> None:
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            raise RuntimeError(f"training diverged: {name} holds non-finite values")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    defaults = TrainingSettings()
    parser = argparse.ArgumentParser(description="Train a DLRM preset on synthetic click logs and write its weights.")
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--data-seed", type=int, default=defaults.data_seed)
    parser.add_argument("--init-seed", type=int, default=defaults.init_seed)
    parser.add_argument("--train-rows", type=int, default=defaults.train_rows)
    parser.add_argument("--heldout-rows", type=int, default=defaults.heldout_rows)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--out", type=Path, default=None,
                        help="safetensors file to write (default: the preset's shipped weights, e.g. "
                             "disagg/weights/tiny/model.safetensors)")
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args(argv)
    out = args.out or preset_weights(args.preset)
    if out is None:
        parser.error(f"preset {args.preset!r} ships no weights; give --out")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    settings = TrainingSettings(
        preset=args.preset, data_seed=args.data_seed, init_seed=args.init_seed, train_rows=args.train_rows,
        heldout_rows=args.heldout_rows, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate,
    )
    console = Console(stderr=True)
    columns = (TextColumn("[bold]training[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"{settings.preset} on {settings.train_rows:,} rows x {settings.epochs} epochs",
                                 total=settings.steps_per_epoch * settings.epochs, loss=float("nan"))
        losses: list[float] = []

        def on_step(step: int, loss: float) -> None:
            losses.append(loss)
            progress.update(task, completed=step, loss=float(np.mean(losses[-50:])))

        model, report = train_preset(settings, on_step)
    _check_finite(model)
    report_path = save(model, report, out)
    size = out.stat().st_size
    console.print(
        f"held-out AUC {report.heldout_auc:.4f} (best achievable {report.best_achievable_auc:.4f}), log loss "
        f"{report.heldout_log_loss:.4f} (best {report.best_achievable_log_loss:.4f}), CTR {report.heldout_ctr:.3f}; "
        f"{report.steps} steps in {report.wall_seconds:.1f} s ({report.cpu_seconds:.1f} CPU s, "
        f"{report.torch_threads} threads)"
    )
    console.print(f"wrote {out} ({size / 2**20:.2f} MiB) and {report_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
