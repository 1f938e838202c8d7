"""Helpers shared by every swiftserve package (serving, disagg, autoconfig)."""
