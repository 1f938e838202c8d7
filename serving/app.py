"""The diffusion application's Serve entry points: ``import_path: serving.app:build_app`` (one base model) or
``serving.app:build_multi_app`` (several, picked by a request's ``model``)."""

from serving.deployments.app import build_app, build_multi_app

__all__ = ["build_app", "build_multi_app"]
