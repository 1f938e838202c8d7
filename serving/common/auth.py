"""Optional API-key auth of both HTTP APIs (diffusion and OIP v2) as one route dependency, and of OIP over gRPC.

With a non-empty key (``SWIFTSERVE_API_KEY``, fixed when the app is created), guarded routes need ``Authorization:
Bearer <key>``; anything else is a 401 in the API's error shape with ``WWW-Authenticate: Bearer`` (plus
``error="invalid_token"`` for a wrong key, RFC 6750 §3). Health probes and the API docs stay open (the full list: the
README's ``SWIFTSERVE_API_KEY`` and docs/RELIABILITY.md). The key and presented tokens are never logged or echoed.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serving.common.errors import APIError
from serving.common.logging import get_logger
from serving.common.tokens import SecretDigest

logger = get_logger("auth")

#: Documents the scheme in OpenAPI (the docs' "Authorize" button); the check itself is ours.
_BEARER = HTTPBearer(auto_error=False, description="`Authorization: Bearer <SWIFTSERVE_API_KEY>`")


class BearerCheck:
    """Checks ``Authorization`` values (an HTTP header, or gRPC metadata) against ``Bearer <api_key>``."""

    def __init__(self, api_key: str) -> None:
        self._expected = SecretDigest(api_key.encode("utf-8"))

    def refusal(self, authorization: str | None, where: str) -> APIError | None:
        """The 401 for ``authorization`` (None: absent), logged with ``where`` (method and path) and the reason;
        None when it carries the key."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()  # whitespace around the token is not part of it
        if not authorization:
            return _refuse(where, "no API key", "missing API key: send the header `Authorization: Bearer <API key>`",
                           "Bearer")
        if scheme.lower() != "bearer" or not token:
            return _refuse(where, "not a Bearer token", "the Authorization header must be `Bearer <API key>`",
                           "Bearer")
        try:
            presented = token.encode("latin-1")  # the header's raw bytes (use an ASCII key)
        except UnicodeEncodeError:
            presented = b""
        if not self._expected.matches(presented):
            return _refuse(where, "wrong API key", "invalid API key", 'Bearer error="invalid_token"')
        return None


def _refuse(where: str, reason: str, message: str, challenge: str) -> APIError:
    logger.info("refused %s: %s", where, reason)
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})


def api_key_dependencies(api_key: str) -> list[DependsParam]:
    """Route dependencies demanding ``Authorization: Bearer <api_key>``; none when ``api_key`` is empty.

    They run before the route, after the body-size cap (413) and after FastAPI parses a JSON body (malformed JSON
    is a 400 even unauthenticated); no model code runs either way. Refusals are logged with method, path and reason.
    """
    if not api_key:
        return []
    check = BearerCheck(api_key)

    async def require_api_key(
        request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
    ) -> None:
        refusal = check.refusal(request.headers.get("authorization"), f"{request.method} {request.url.path}")
        if refusal is not None:
            raise refusal

    return [Depends(require_api_key)]
