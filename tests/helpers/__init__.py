"""What several test modules share: fake backends and files, certificates, shard servers, replica access."""

from pathlib import Path

#: The repository root, for tests that read its files (configs, scripts, manifests).
REPO = Path(__file__).resolve().parents[2]
