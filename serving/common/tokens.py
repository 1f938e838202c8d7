"""The one shared-secret check: the HTTP API key and the embedding RPC's bearer token both use it."""

from __future__ import annotations

import hashlib
import hmac


class SecretDigest:
    """A secret kept only as its SHA-256 digest. ``matches`` compares a presented token in constant time
    (``hmac.compare_digest`` of digests, so neither its content nor its length leaks through timing)."""

    __slots__ = ("_digest",)

    def __init__(self, secret: bytes) -> None:
        self._digest = hashlib.sha256(secret).digest()

    def matches(self, presented: bytes) -> bool:
        return hmac.compare_digest(hashlib.sha256(presented).digest(), self._digest)
