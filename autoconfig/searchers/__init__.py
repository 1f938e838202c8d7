"""Searchers over a search space, all behind :class:`Searcher`; ``SEARCHERS`` builds them by name."""

from autoconfig.searchers.base import Observation, Searcher, SearcherFactory, SpaceExhausted
from autoconfig.searchers.grid import GridSearcher
from autoconfig.searchers.meta import MetaParams, MetaSearcher, meta_factory
from autoconfig.searchers.optuna_searchers import GPSearcher, TPESearcher
from autoconfig.searchers.random import RandomSearcher

SEARCHERS: dict[str, SearcherFactory] = {
    "grid": lambda space, seed, prior: GridSearcher(space),
    "random": lambda space, seed, prior: RandomSearcher(space, seed),
    "tpe": lambda space, seed, prior: TPESearcher(space, seed),
    "gp": lambda space, seed, prior: GPSearcher(space, seed),
    "meta": meta_factory(),
}

__all__ = [
    "SEARCHERS",
    "GPSearcher",
    "GridSearcher",
    "MetaParams",
    "MetaSearcher",
    "Observation",
    "RandomSearcher",
    "Searcher",
    "SearcherFactory",
    "SpaceExhausted",
    "TPESearcher",
    "meta_factory",
]
