"""Searchers over a search space, all behind :class:`Searcher`; ``SEARCHERS`` builds them by name."""

from autoconfig.searchers.base import Observation, Searcher, SearcherFactory, SpaceExhausted
from autoconfig.searchers.grid import GridSearcher
from autoconfig.searchers.meta import MetaParams, MetaSearcher, meta_factory
from autoconfig.searchers.optuna_searchers import GPSearcher, ParetoSearcher, TPESearcher
from autoconfig.searchers.random import RandomSearcher
from autoconfig.searchers.rgpe import RGPESearcher
from autoconfig.searchers.transfer import BestOnAverageSearcher, WarmTPESearcher

SEARCHERS: dict[str, SearcherFactory] = {
    "grid": lambda space, seed, prior, target=None: GridSearcher(space),
    "random": lambda space, seed, prior, target=None: RandomSearcher(space, seed),
    "tpe": lambda space, seed, prior, target=None: TPESearcher(space, seed),
    "gp": lambda space, seed, prior, target=None: GPSearcher(space, seed),
    "meta": meta_factory(),
    # Baselines that use the bank too: no learning, the meta-learned prior without adapting, warm-started TPE.
    "best-on-average": lambda space, seed, prior, target=None: BestOnAverageSearcher(space, prior),
    "prior-only": meta_factory(adapt=False),
    "tpe-warm": lambda space, seed, prior, target=None: WarmTPESearcher(space, seed, prior),
    # Transfer with uncertainty: a ranking-weighted GP ensemble of the other models and this one's trials.
    # Before it ranks two trials, the other models weigh by how alike their descriptions are to ``target``.
    "rgpe": lambda space, seed, prior, target=None: RGPESearcher(space, seed, prior, target=target),
    # Multi-objective: the objective and the p99, under the limits (Optuna's constraints).
    "pareto": lambda space, seed, prior, target=None: ParetoSearcher(space, seed),
}

__all__ = [
    "SEARCHERS",
    "BestOnAverageSearcher",
    "GPSearcher",
    "GridSearcher",
    "MetaParams",
    "MetaSearcher",
    "Observation",
    "ParetoSearcher",
    "RGPESearcher",
    "RandomSearcher",
    "Searcher",
    "SearcherFactory",
    "SpaceExhausted",
    "TPESearcher",
    "WarmTPESearcher",
    "meta_factory",
]
