"""Optional API-key auth shared by the OpenAI-style diffusion API and the OIP v2 DLRM API.

Auth is on when the app is created with a non-empty key (deployments pass ``constants.API_KEY``, i.e.
``SWIFTSERVE_API_KEY``); the key is fixed at app creation, never read from the environment per request.
Protected routes then need ``Authorization: Bearer <key>``; anything else is a 401 with
``WWW-Authenticate: Bearer`` (plus ``error="invalid_token"`` for a wrong key, RFC 6750 §3), rendered in
the API's own error shape, before the route runs (the request-body cap's 413 comes first, and FastAPI
parses a JSON body before route dependencies, so malformed JSON on a JSON route is a 400 even
unauthenticated; no model code runs either way).

Which routes are open (no key needed): as Triton's ``--http-restricted-api`` restricting every category but
``health``, except that per-model readiness (in Triton's ``health`` category) needs the key here:

- diffusion: ``GET /health``; OIP: ``GET /v2/health/live`` and ``GET /v2/health/ready`` (the probes
  orchestrators and load balancers call without credentials);
- the API docs (``/docs``, ``/redoc``, ``/openapi.json``): schemas only, no model or server details.

Everything else needs the key: inference (``POST /v1/images/generations``, ``POST /v2/models/{m}[/versions/
{v}]/infer``), model listing and metadata (``GET /v1/models`` as OpenAI does, ``GET /v2/models/{m}[...]``:
names, input shapes, table sizes), per-model readiness (``GET /v2/models/{m}[...]/ready``: it names a model,
and its 404 would tell the served model's name) and server metadata (``GET /v2``: version and extensions).
Unknown routes stay 404.

The presented token is compared in constant time (``hmac.compare_digest`` on SHA-256 digests, so its
length leaks nothing either); neither the key nor a presented token is ever logged or put in a response.
Refusals are logged at INFO with method, path (no query string) and reason. Header values arrive as
latin-1 text, so the token is compared as those raw bytes against the key's UTF-8 bytes; use an ASCII key
(``openssl rand -hex 32``).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serving.common.http import APIError
from serving.common.logging import get_logger

logger = get_logger("auth")

#: Documents the scheme in OpenAPI (the docs' "Authorize" button); the check itself is ours.
_BEARER = HTTPBearer(auto_error=False, description="`Authorization: Bearer <SWIFTSERVE_API_KEY>`")


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def _refuse(request: Request, reason: str, message: str, challenge: str) -> APIError:
    logger.info("refused %s %s: %s", request.method, request.url.path, reason)
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})


def api_key_dependencies(api_key: str) -> list[DependsParam]:
    """Route dependencies demanding ``Authorization: Bearer <api_key>``; none when ``api_key`` is empty."""
    if not api_key:
        return []
    expected = _digest(api_key.encode("utf-8"))

    async def require_api_key(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
    ) -> None:
        if credentials is None:  # no header, an empty token, or another scheme (Basic, ...)
            if request.headers.get("authorization"):
                raise _refuse(
                    request, "not a Bearer token", "the Authorization header must be `Bearer <API key>`", "Bearer"
                )
            raise _refuse(
                request, "no API key", "missing API key: send the header `Authorization: Bearer <API key>`", "Bearer"
            )
        try:
            presented = credentials.credentials.encode("latin-1")  # the header's raw bytes
        except UnicodeEncodeError:
            presented = b""
        if not hmac.compare_digest(_digest(presented), expected):
            raise _refuse(request, "wrong API key", "invalid API key", 'Bearer error="invalid_token"')

    return [Depends(require_api_key)]
