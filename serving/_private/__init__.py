"""Internals of the diffusion serving package; not a public API."""
