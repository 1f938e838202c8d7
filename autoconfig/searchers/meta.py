"""The meta-learned searcher (Morphling): an MLP surrogate meta-trained with Reptile on past surfaces.

The first suggestion is the configuration that is most often the optimum of the training surfaces (the opening);
each later one adapts the meta-weights to the trials so far and maximises ``after + delta * |after - before|`` (the
prediction adapted to every trial, and to all but the latest); the algorithm: docs/AUTOCONFIG.md, "Searchers".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from autoconfig.bank import BankEntry
from autoconfig.searchers.base import Observation, Searcher, SearcherFactory, comparable, objective_values
from autoconfig.space import Configuration, SearchSpace

Surface = tuple[np.ndarray, np.ndarray]  # encoded configurations (n, d), objective values (n,) with failures 0
WEIGHTS_FILE, PARAMS_FILE = "meta.safetensors", "meta.json"


class MetaParams(BaseModel):
    """Hyperparameters of meta-training and adaptation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden: int = Field(128, ge=1, description="Units in each of the two hidden layers.")
    meta_iterations: int = Field(100, ge=1, description="Reptile steps.")
    meta_lr: float = Field(0.5, gt=0, le=1, description="Reptile step size, annealed linearly to 0.")
    meta_batch: int = Field(8, ge=1, description="Tasks adapted in parallel per Reptile step.")
    task_size: int = Field(32, ge=1, description="Configurations sampled per meta-training task.")
    adapt_steps: int = Field(20, ge=1, description="Adam steps adapting to a task or to the trials so far.")
    adapt_lr: float = Field(0.02, gt=0, description="Adam learning rate of adaptation.")
    delta: float = Field(0.25, ge=0, description="Weight of the prediction change in the acquisition.")
    opening: bool = Field(True, description="Open with the surfaces' most frequent optimum, not the surrogate's best.")


class _SavedMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    knobs: tuple[str, ...]
    params: MetaParams
    opening: dict[str, Any] | None = None


class MetaSearcher(Searcher):
    """Suggests by a surrogate adapted from meta-learned weights; deterministic given the weights."""

    def __init__(
        self,
        space: SearchSpace,
        weights: dict[str, torch.Tensor],
        params: MetaParams,
        *,
        adapt: bool = True,
        opening: Configuration | None = None,
    ) -> None:
        super().__init__(space)
        self.weights = weights
        self.params = params
        self.adapt = adapt  # False: rank by the meta-learned prior alone, never adapting (the ablation baseline)
        self.opening = opening  # the first suggestion; None: the prior's best
        self._features = torch.from_numpy(np.array(space.encode_all(), dtype=np.float32))

    @classmethod
    def meta_train(
        cls,
        space: SearchSpace,
        surfaces: Sequence[Surface],
        seed: int = 0,
        params: MetaParams | None = None,
        *,
        adapt: bool = True,
    ) -> MetaSearcher:
        """Meta-train on ``surfaces`` (encoded like ``space``) and return a searcher for ``space``."""
        params = params or MetaParams()
        dim = len(space.knob_names)
        if not surfaces:
            raise ValueError("meta-training needs at least one surface")
        for i, (features, values) in enumerate(surfaces):
            if features.ndim != 2 or features.shape[1] != dim or values.shape != features.shape[:1]:
                raise ValueError(f"surfaces[{i}]: shapes {features.shape}, {values.shape} do not fit {dim} knobs")
            if not (np.isfinite(values).all() and (values >= 0).all()):
                raise ValueError(f"surfaces[{i}]: objective values must be finite and >= 0 (failures as 0)")
        rng = np.random.default_rng(seed)
        weights = _initial_weights(dim, params.hidden, torch.Generator().manual_seed(seed))
        tasks = [(torch.from_numpy(f.astype(np.float32)), torch.from_numpy(v.astype(np.float32))) for f, v in surfaces]
        for step in range(params.meta_iterations):
            batch = [tasks[t] for t in rng.integers(len(tasks), size=params.meta_batch)]
            chosen = [
                torch.from_numpy(rng.choice(len(v), size=min(params.task_size, len(v)), replace=False))
                for _, v in batch
            ]
            features = torch.stack([f[c] for (f, _), c in zip(batch, chosen, strict=True)])
            values = torch.stack([v[c] for (_, v), c in zip(batch, chosen, strict=True)])
            top = values.max(dim=1, keepdim=True).values
            targets = torch.where(top > 0, values / top.clamp(min=1e-12), values)
            adapted = _adapt(weights, features, targets, torch.ones_like(targets), params)
            epsilon = params.meta_lr * (1 - step / params.meta_iterations)
            weights = {k: w + epsilon * (adapted[k].mean(dim=0) - w) for k, w in weights.items()}
        searcher = cls(space, weights, params, adapt=adapt)
        if params.opening:
            searcher.opening = searcher.most_frequent_optimum(surfaces)
        return searcher

    def most_frequent_optimum(self, surfaces: Sequence[Surface]) -> Configuration | None:
        """The configuration of the space nearest to the most surfaces' optima (ties: the prior's best of them);
        None when no surface has a positive value. Before any trial it is the likeliest optimum, which the
        surrogate's best (a smoothed mean of the surfaces) need not be."""
        counts = np.zeros(self.space.size)
        nothing_observed = np.zeros(self.space.size, dtype=bool)
        for features, values in surfaces:
            if values.max() > 0:
                counts[self.nearest_unobserved(features[int(np.argmax(values))], nothing_observed)] += 1
        if not counts.any():
            return None
        tied = counts == counts.max()
        score = np.where(tied, self._prior_scores(), -np.inf)
        return self.space.configurations()[int(np.argmax(score))]

    def save(self, directory: str | Path) -> None:
        """Write the meta-weights (safetensors) and their hyperparameters (JSON) into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.weights.items()}, directory / WEIGHTS_FILE)
        saved = _SavedMeta(knobs=self.space.knob_names, params=self.params,
                           opening=None if self.opening is None else self.opening.as_dict())
        (directory / PARAMS_FILE).write_text(saved.model_dump_json(indent=1) + "\n")

    @classmethod
    def load(cls, space: SearchSpace, directory: str | Path) -> MetaSearcher:
        """A searcher for ``space`` from weights saved by :meth:`save` over a space with the same knobs."""
        directory = Path(directory)
        saved = _SavedMeta.model_validate_json((directory / PARAMS_FILE).read_text())
        if saved.knobs != space.knob_names:
            raise ValueError(f"{directory}: meta-weights are for knobs {saved.knobs}, the space has {space.knob_names}")
        weights = load_file(directory / WEIGHTS_FILE)
        expected = _initial_weights(len(saved.knobs), saved.params.hidden, torch.Generator())
        if {k: v.shape for k, v in weights.items()} != {k: v.shape for k, v in expected.items()}:
            raise ValueError(f"{directory}: {WEIGHTS_FILE} does not hold a {saved.params.hidden}-unit surrogate")
        return cls(space, weights, saved.params,
                   opening=None if saved.opening is None else space.configuration(saved.opening))

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        if not history and self.opening is not None:
            return self.space.index(self.opening)
        if history and self.adapt:
            # Two adaptations in one batch: to every trial ("after") and to all but the latest ("before").
            values = objective_values(history)
            scale = values.max() if values.max() > 0 else 1.0
            indices = [self.space.index(o.config) for o in history]
            features = self._features[indices].expand(2, -1, -1)
            targets = torch.from_numpy((values / scale).astype(np.float32)).expand(2, -1)
            mask = torch.ones(2, len(history))
            mask[1, -1] = 0.0
            adapted = _adapt(self.weights, features, targets, mask, self.params)
            after, before = _forward(adapted, self._features.expand(2, -1, -1))
            score = after + self.params.delta * (after - before).abs()
            score = score.numpy().astype(np.float64)
        else:
            score = self._prior_scores()
        score[observed] = -np.inf
        return int(np.argmax(score))

    def _prior_scores(self) -> np.ndarray:
        """The meta-learned surrogate's prediction at every configuration, before any adaptation."""
        weights = {k: v.unsqueeze(0) for k, v in self.weights.items()}
        return _forward(weights, self._features.unsqueeze(0))[0].numpy().astype(np.float64)


def bank_surfaces(entries: Sequence[BankEntry]) -> list[Surface]:
    """Each full-grid entry, encoded by its own space, as a training surface (failed trials count as 0)."""
    surfaces = []
    for entry in entries:
        _, values = entry.surface()
        surfaces.append((np.asarray(entry.space.encode_all()), np.nan_to_num(values, nan=0.0)))
    return surfaces


def meta_factory(params: MetaParams | None = None, *, adapt: bool = True) -> SearcherFactory:
    """A factory that meta-trains, with the run's seed, on the prior entries over the same knobs as the space
    (``adapt=False``: the prior-only ranking)."""

    def build(space: SearchSpace, seed: int, prior: Sequence[BankEntry],
              target: Mapping[str, Any] | None = None) -> Searcher:
        # Only surfaces over the same knobs share the surrogate's inputs (DLRM and diffusion spaces may differ).
        return MetaSearcher.meta_train(space, bank_surfaces(comparable(space, prior)), seed=seed, params=params,
                                       adapt=adapt)

    return build


def _initial_weights(dim: int, hidden: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Two hidden layers of ``hidden`` ReLU units, initialised like ``torch.nn.Linear``."""
    weights = {}
    for i, (fan_in, fan_out) in enumerate(((dim, hidden), (hidden, hidden), (hidden, 1)), start=1):
        bound = fan_in**-0.5
        weights[f"w{i}"] = (torch.rand(fan_in, fan_out, generator=generator) * 2 - 1) * bound
        weights[f"b{i}"] = (torch.rand(fan_out, generator=generator) * 2 - 1) * bound
    return weights


def _forward(weights: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    """Per-task predictions ``(T, n)`` of task-batched weights ``(T, ...)`` on features ``(T, n, d)``."""
    hidden = features
    for i in (1, 2, 3):
        hidden = torch.baddbmm(weights[f"b{i}"].unsqueeze(1), hidden, weights[f"w{i}"])
        if i < 3:
            hidden = torch.relu(hidden)
    return hidden.squeeze(-1)


def _adapt(
    weights: dict[str, torch.Tensor],
    features: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    params: MetaParams,
) -> dict[str, torch.Tensor]:
    """``T`` copies of ``weights``, each after ``adapt_steps`` Adam steps on its task's masked squared error."""
    tasks = features.shape[0]
    adapted = {k: v.expand(tasks, *v.shape).clone().requires_grad_() for k, v in weights.items()}
    optimiser = torch.optim.Adam(adapted.values(), lr=params.adapt_lr)
    counts = mask.sum(dim=1).clamp(min=1)
    with torch.enable_grad():
        for _ in range(params.adapt_steps):
            optimiser.zero_grad()
            errors = (_forward(adapted, features) - targets) ** 2 * mask
            (errors.sum(dim=1) / counts).sum().backward()
            optimiser.step()
    return {k: v.detach() for k, v in adapted.items()}
