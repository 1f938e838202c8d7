"""Serve application builder: ``import_path: serving.app:build_app`` in a Serve config."""

# No ``from __future__ import annotations``: Ray reads the annotation to validate ``args``.
from ray.serve import Application

from serving.config import DiffusionAppConfig
from serving.deployments import DiffusionModel, ImagesIngress


def build_app(args: DiffusionAppConfig) -> Application:
    """``ImagesIngress`` -> ``DiffusionModel``; Ray validates ``args`` into a ``DiffusionAppConfig``."""
    if not isinstance(args, DiffusionAppConfig):
        args = DiffusionAppConfig.model_validate(args)
    return ImagesIngress.bind(DiffusionModel.bind(args), args)
