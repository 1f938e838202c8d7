"""The shared-secret check both the HTTP API key and the embedding RPC token use."""

import hashlib

from serving.common.tokens import SecretDigest

SECRET = b"k3y-Zq81-never-kept"


def test_only_the_exact_secret_matches():
    digest = SecretDigest(SECRET)
    assert digest.matches(SECRET)
    for presented in (b"", SECRET[:-1], SECRET + b"x", SECRET.upper(), b" " + SECRET):
        assert not digest.matches(presented)


def test_only_the_digest_is_kept():
    digest = SecretDigest(SECRET)
    assert not hasattr(digest, "__dict__")
    kept = [getattr(digest, slot) for slot in SecretDigest.__slots__]
    assert kept == [hashlib.sha256(SECRET).digest()]
    assert SECRET.decode() not in repr(digest)
