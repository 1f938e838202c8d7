"""Test-wide setup: everything runs offline; no test may reach a model hub."""

import os

from hypothesis import settings

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Hypothesis: the same examples on every run (a failure in CI reproduces locally);
# HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("repeatable", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", database=None, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))
