"""The diffusion application's Serve entry point: ``import_path: serving.app:build_app``."""

from serving.deployments.app import build_app

__all__ = ["build_app"]
