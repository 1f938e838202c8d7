"""Labelled synthetic click logs with a known ground truth, for training and checking a DLRM.

Features come from :class:`disagg.synthetic.SyntheticRequests`; the click probability is a logistic model the
generator holds (first-order id effects, table crosses as DLRM's dot interaction represents them, one dense x table
cross: :class:`GroundTruth`), so the Bayes-optimal AUC of any sample is known.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from disagg.spec import DLRMSpec, preset_spec
from disagg.synthetic import SyntheticRequests

#: Scale of each ground-truth term (standard deviation of its parameters); chosen so a DLRM trained on a few hundred
#: thousand rows of the tiny preset gets close to the Bayes-optimal AUC (README, "Trained demo models").
DENSE_SCALE = 0.15
EFFECT_SCALE = 0.45
CROSS_SCALE = 0.5
LATENT_DIM = 4
EFFECT_TABLES = 8
CROSS_PAIRS = 5

_CALIBRATION_STREAM = 2**32 - 1  # a stream no caller uses, for the bias calibration sample
_CALIBRATION_ROWS = 50_000


@dataclass(frozen=True)
class ClickBatch:
    """Rows of a click log: features as a DLRM takes them, the true click probability and the drawn labels."""

    dense: torch.Tensor  # float32 [rows, num_dense]
    sparse: torch.Tensor  # int64 [rows, num_tables, H], -1 padding
    probability: torch.Tensor  # float64 [rows], the ground truth
    labels: torch.Tensor  # float32 [rows], 1.0 = click, Bernoulli(probability)

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass(frozen=True)
class GroundTruth:
    """Parameters of the click model; tables are indices into ``spec.table_sizes``.

    ``logit = bias + w . dense + sum_t effect_t[bag_t] + CROSS_SCALE * sum_(t,u) <v_t[bag_t], v_u[bag_u]>
    + <P dense, v_s[bag_s]>``, a bag contributing the sum over its ids (``EmbeddingBag(mode="sum")``, -1 padding).
    """

    bias: float
    dense_weights: np.ndarray  # [num_dense]
    effects: dict[int, np.ndarray]  # table -> [rows] scalar effect per id
    latents: dict[int, np.ndarray]  # table -> [rows, LATENT_DIM] vector per id
    crosses: tuple[tuple[int, int], ...]  # pairs of tables whose latent vectors interact
    dense_cross_table: int  # table whose latent vector interacts with ``dense_projection @ dense``
    dense_projection: np.ndarray  # [LATENT_DIM, num_dense]


class ClickLogs:
    """Seeded generator of labelled click logs for a DLRM ``spec``: ``batch(rows)`` draws the next rows.

    The same ``(seed, stream)`` gives the same rows; streams of one seed share the ground truth and the feature
    distribution and are independent samples of it. ``bias`` is calibrated so the mean click-through rate is
    ``target_ctr``. The ground truth holds a value per row of the tables it uses, so it is meant for specs with
    small tables (``tiny``, ``small``).
    """

    def __init__(
        self,
        spec: DLRMSpec,
        *,
        seed: int = 0,
        stream: int = 0,
        target_ctr: float = 0.15,
        zipf_alpha: float = 1.05,
        max_hotness: int = 1,
    ) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0.0 < target_ctr < 1.0:
            raise ValueError(f"target_ctr must be in (0, 1), got {target_ctr}")
        if not 0 <= stream < _CALIBRATION_STREAM:
            raise ValueError(f"stream must be in [0, {_CALIBRATION_STREAM}), got {stream}")
        if spec.num_tables < 2:
            raise ValueError(f"the click model crosses pairs of tables; the spec has {spec.num_tables}")
        self.spec, self.seed, self.stream, self.target_ctr = spec, seed, stream, target_ctr
        self._feature_options = {"zipf_alpha": zipf_alpha, "max_hotness": max_hotness}
        self._features = self._feature_stream(stream)
        self._labels = np.random.default_rng([seed, stream, 1])
        self.truth = self._draw_truth()

    def batch(self, rows: int) -> ClickBatch:
        """The next ``rows`` labelled rows."""
        dense, sparse = self._features.batch(rows)
        probability = self.ground_truth_probability((dense, sparse))
        labels = self._labels.random(rows) < probability.numpy()
        return ClickBatch(dense, sparse, probability, torch.from_numpy(labels.astype(np.float32)))

    def ground_truth_probability(self, batch: ClickBatch | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The true click probability, float64 [rows], of ``batch`` (a ClickBatch or ``(dense, sparse)``)."""
        dense, sparse = (batch.dense, batch.sparse) if isinstance(batch, ClickBatch) else batch
        return torch.from_numpy(_sigmoid(_logit(self.truth, dense.numpy().astype(np.float64), sparse.numpy())))

    def _feature_stream(self, stream: int) -> SyntheticRequests:
        """SyntheticRequests for ``seed`` (the feature distribution) drawing its rows for ``stream``."""
        return SyntheticRequests(self.spec, seed=self.seed, stream=stream, **self._feature_options)

    def _draw_truth(self) -> GroundTruth:
        spec = self.spec
        rng = np.random.default_rng([self.seed, 2**32 - 2])  # parameters: independent of every sample stream
        tables = spec.num_tables
        effect_tables = sorted(rng.choice(tables, size=min(EFFECT_TABLES, tables), replace=False).tolist())
        all_pairs = [(i, j) for i in range(tables) for j in range(i + 1, tables)]
        picked = rng.choice(len(all_pairs), size=min(CROSS_PAIRS, len(all_pairs)), replace=False)
        crosses = tuple(sorted(all_pairs[index] for index in picked))
        dense_cross_table = int(rng.integers(tables))
        latent_tables = sorted({table for pair in crosses for table in pair} | {dense_cross_table})
        latent_scale = 1.0 / math.sqrt(math.sqrt(LATENT_DIM))  # a dot of two latents has variance ~1
        truth = GroundTruth(
            bias=0.0,
            dense_weights=rng.normal(0.0, DENSE_SCALE, spec.num_dense),
            effects={t: rng.normal(0.0, EFFECT_SCALE, spec.table_sizes[t]) for t in effect_tables},
            latents={t: rng.normal(0.0, latent_scale, (spec.table_sizes[t], LATENT_DIM)) for t in latent_tables},
            crosses=crosses,
            dense_cross_table=dense_cross_table,
            dense_projection=rng.normal(0.0, DENSE_SCALE / math.sqrt(spec.num_dense),
                                        (LATENT_DIM, spec.num_dense)),
        )
        return dataclasses.replace(truth, bias=self._calibrated_bias(truth))

    def _calibrated_bias(self, truth: GroundTruth) -> float:
        """The bias giving ``truth`` a mean probability of ``target_ctr`` on a calibration sample (bisection)."""
        dense, sparse = self._feature_stream(_CALIBRATION_STREAM).batch(_CALIBRATION_ROWS)
        logit = _logit(truth, dense.numpy().astype(np.float64), sparse.numpy())
        low, high = -30.0, 30.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if _sigmoid(logit + middle).mean() < self.target_ctr else (low, middle)
        return (low + high) / 2


def roc_auc(scores: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (ties count half)."""
    scores, labels = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(labels).ravel()
    return float(roc_auc_score(labels, scores))


def best_achievable_auc(n: int, seed: int = 0, *, spec: DLRMSpec | None = None, stream: int = 0) -> float:
    """The Bayes-optimal AUC on ``n`` rows of stream ``stream``: the AUC of the true probability on their labels.

    No model scores those labels better in expectation; ``spec`` defaults to the ``tiny`` preset.
    """
    logs = ClickLogs(spec or preset_spec("tiny"), seed=seed, stream=stream)
    batch = logs.batch(n)
    return roc_auc(batch.probability, batch.labels)


def _logit(truth: GroundTruth, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """The ground-truth logit of rows ``dense`` [rows, num_dense] float64, ``sparse`` [rows, tables, H]."""
    logit = dense @ truth.dense_weights + truth.bias
    for table, effect in truth.effects.items():
        logit += _bag_sum(effect[:, None], sparse[:, table])[:, 0]
    bags = {table: _bag_sum(latent, sparse[:, table]) for table, latent in truth.latents.items()}
    for left, right in truth.crosses:
        logit += CROSS_SCALE * np.einsum("rk,rk->r", bags[left], bags[right])
    logit += np.einsum("rk,rk->r", dense @ truth.dense_projection.T, bags[truth.dense_cross_table])
    return logit


def _bag_sum(values: np.ndarray, bags: np.ndarray) -> np.ndarray:
    """``values`` [rows_of_table, k] summed over each bag's ids (``bags`` [rows, H], -1 padding) -> [rows, k]."""
    present = (bags >= 0)[..., None]
    return (values[np.clip(bags, 0, None)] * present).sum(axis=1)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|
