"""The DLRM application's Serve entry point: ``import_path: disagg.app:build_app``."""

from disagg.deployments.app import build_app

__all__ = ["build_app"]
