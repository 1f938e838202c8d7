"""Integration tests: one Ray cluster per session (``conftest.py``), which authenticates with a fresh token as a
`ray start --head` cluster does. Every process of the session, and each one it starts, finds the token in the
environment, as docs/DEPLOYMENT.md has every node and caller get it; set here, before anything imports Ray (a process
reads the mode once)."""

import os
import secrets

os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
