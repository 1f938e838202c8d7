"""Deployment configuration for swiftserve applications (``autoconfig`` CLI)."""

__version__ = "0.1.0"
