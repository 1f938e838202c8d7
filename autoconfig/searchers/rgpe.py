"""Transfer with uncertainty: a ranking-weighted ensemble of Gaussian processes (RGPE, Feurer et al. 2018).

One GP per other model's profile (its surface divided by its best, failures 0) and one on this model's trials so
far (divided by their best). Before ``rank_from`` trials each other model weighs by how alike its description is
to this model's (``context``; equal weights without a description). From then on each GP is weighted by how often,
over posterior samples, it ranks the trials seen so far best (pairwise misrankings; the target GP, from
``_TARGET_AFTER`` trials, judged leave-one-out), times that likeness; a prior GP that misranks more than the
target GP's 95th percentile gets no weight. The ensemble's mean is the weighted mean, its variance the weighted
sum of variances with squared weights, and the next configuration maximises expected improvement. With
``noise_aware`` each GP smooths its values by measurement noise: a prior model's by its entry's repeats
(``BankEntry.noise``), this model's by the median of those.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.stats import norm

from autoconfig.bank import BankEntry
from autoconfig.searchers.base import Observation, Searcher, comparable, objective_values
from autoconfig.searchers.context import context_weights
from autoconfig.searchers.transfer import prior_surfaces
from autoconfig.space import SearchSpace

_JITTER = 1e-4  # noise variance, relative to the signal's, where no measurement noise is known
_LENGTHSCALES = (0.1, 0.2, 0.4, 0.8)  # the one with the best marginal likelihood is used
_MIN_VARIANCE = 1e-4  # signal variance of a GP on constant values
_TARGET_AFTER = 5  # trials before this model's own GP joins the ensemble (its ranking is noise before)


class _GP:
    """A GP with a squared-exponential kernel over encoded configurations, centred on the values' mean. Its signal
    variance is the values' variance; its noise variance that of measurements with ``relative_noise`` (std over
    mean, the bank's noise estimate) at the values' mean magnitude, or a jitter when None; the lengthscale is the
    one of ``_LENGTHSCALES`` with the highest marginal likelihood of the data."""

    def __init__(self, points: np.ndarray, values: np.ndarray, relative_noise: float | None = None) -> None:
        self.points = points
        self.mean_value = float(values.mean())
        centred = self._centred = values - self.mean_value
        self.amplitude = max(float(centred.var()), _MIN_VARIANCE)
        self.noise = _JITTER * self.amplitude
        if relative_noise is not None:
            self.noise = max(self.noise, (relative_noise * float(np.abs(values).mean())) ** 2)
        best = None
        for lengthscale in _LENGTHSCALES:
            kernel = self.amplitude * _kernel(points, points, lengthscale) + self.noise * np.eye(len(points))
            factor = cho_factor(kernel, lower=True)
            alpha = cho_solve(factor, centred)
            fit = -0.5 * centred @ alpha - np.log(np.diag(factor[0])).sum()
            if best is None or fit > best[0]:
                best = (fit, lengthscale, factor, alpha)
        _, self.lengthscale, self._factor, self._alpha = best

    def predict(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of the noiseless value at ``points``."""
        cross = self.amplitude * _kernel(points, self.points, self.lengthscale)
        mean = self.mean_value + cross @ self._alpha
        variance = self.amplitude - np.einsum("ij,ji->i", cross, cho_solve(self._factor, cross.T))
        return mean, np.sqrt(np.clip(variance, 1e-12, None))

    def loo(self) -> tuple[np.ndarray, np.ndarray]:
        """Leave-one-out mean and standard deviation (of a measurement) at each training point, in closed form."""
        inverse_diagonal = np.diag(cho_solve(self._factor, np.eye(len(self.points))))
        mean = self.mean_value + self._centred - self._alpha / inverse_diagonal
        return mean, np.sqrt(1.0 / inverse_diagonal)


def _kernel(a: np.ndarray, b: np.ndarray, lengthscale: float) -> np.ndarray:
    distances = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=-1)
    return np.exp(-0.5 * distances / lengthscale**2)


class RGPESearcher(Searcher):
    """Ranking-weighted GP ensemble over the prior profiles and the trials so far; expected improvement."""

    def __init__(self, space: SearchSpace, seed: int, prior: Sequence[BankEntry], samples: int = 256, *,
                 target: Mapping[str, Any] | None = None, rank_from: int = 2, noise_aware: bool = True) -> None:
        super().__init__(space)
        self._rng = np.random.default_rng(seed)
        self._samples = samples
        self._rank_from = max(rank_from, 2)  # one trial ranks nothing
        points = np.asarray(space.encode_all())
        self._points = points
        usable = comparable(space, prior)
        noises = [entry.noise() if noise_aware else None for entry in usable]
        known_noises = [noise for noise in noises if noise is not None]
        self._target_noise = float(np.median(known_noises)) if known_noises else None
        self._base: list[tuple[np.ndarray, np.ndarray]] = []  # each prior GP's mean and sd at every configuration
        for row, noise in zip(prior_surfaces(space, usable), noises, strict=True):
            known = ~np.isnan(row)
            self._base.append(_GP(points[known], row[known], noise).predict(points))
        self.likeness = (np.full(len(usable), 1.0 / len(usable)) if target is None
                         else context_weights(target, [entry.model.model_dump() for entry in usable]))

    def _suggest(self, history: Sequence[Observation], observed: np.ndarray) -> int:
        means = [mean for mean, _ in self._base]
        sds = [sd for _, sd in self._base]
        weights = self.likeness
        if history:
            values = objective_values(history)
            scale = values.max() if values.max() > 0 else 1.0
            targets = values / scale
            indices = np.array([self.space.index(o.config) for o in history])
            if len(history) >= self._rank_from:
                target = None
                if len(history) >= _TARGET_AFTER:  # joins once ranked, so never before rank_from
                    target = _GP(self._points[indices], targets, self._target_noise)
                    mean, sd = target.predict(self._points)
                    means, sds = [*means, mean], [*sds, sd]
                weights = self._weights(indices, targets, target)
        mean = sum(w * m for w, m in zip(weights, means, strict=True))
        sd = np.sqrt(sum(w**2 * s**2 for w, s in zip(weights, sds, strict=True)))
        # The incumbent in the ensemble's own units: its mean at the best trial so far.
        best = float(mean[self.space.index(max(history, key=lambda o: o.value or 0.0).config)]) if history else 0.0
        improvement = mean - best
        z = improvement / np.maximum(sd, 1e-9)
        score = improvement * norm.cdf(z) + sd * norm.pdf(z)
        score[observed] = -np.inf
        return int(np.argmax(score))

    def _weights(self, indices: np.ndarray, targets: np.ndarray, target: _GP | None) -> np.ndarray:
        """Each model's share of posterior samples in which it misranks the fewest pairs of trials (ties shared),
        the other models' shares times their likeness; the target's GP last when it has one."""
        draws = [self._rng.normal(mean[indices], sd[indices], size=(self._samples, len(indices)))
                 for mean, sd in self._base]
        if target is not None:
            loo_mean, loo_sd = target.loo()
            draws.append(self._rng.normal(loo_mean, loo_sd, size=(self._samples, len(indices))))
        losses = np.stack([_misranked(draw, targets) for draw in draws])  # (models, samples)
        if target is not None:
            threshold = np.percentile(losses[-1], 95)
            losses[:-1][np.median(losses[:-1], axis=1) > threshold] = np.iinfo(np.int64).max
        winners = losses == losses.min(axis=0, keepdims=True)
        shares = (winners / winners.sum(axis=0, keepdims=True)).sum(axis=1)
        shares[: len(self._base)] *= self.likeness * len(self._base)  # equal likeness leaves the shares as they are
        if not shares.sum() > 0:
            return np.append(self.likeness, 0.0) if target is not None else self.likeness
        return shares / shares.sum()


def _misranked(draws: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per sample (row of ``draws``), the pairs of trials whose order it gets wrong."""
    predicted = draws[:, :, None] < draws[:, None, :]
    actual = targets[:, None] < targets[None, :]
    return (predicted != actual).sum(axis=(1, 2)).astype(np.int64)
