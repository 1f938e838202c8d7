"""HTTP plumbing shared by the OpenAI-style and the OIP v2 APIs.

Each API renders errors in its own wire shape; what counts as an error, which status it gets and
which request field it names is decided here once, so both APIs behave the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.common.logging import get_logger

logger = get_logger("http")


class APIError(Exception):
    """An error answered to the client: status, message and, when a request field is at fault, its path."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def __reduce__(self):  # travels between Serve replicas intact
        return (_rebuild_api_error, (self.status_code, self.message, self.param, self.code, self.headers))


def _rebuild_api_error(status_code: int, message: str, param: str | None, code: str | None,
                       headers: dict[str, str] | None) -> APIError:
    return APIError(status_code, message, param=param, code=code, headers=headers)


ErrorRenderer = Callable[[APIError], Response]


def field_path(loc: Sequence[Any]) -> str:
    """``("body", "inputs", 0, "datatype")`` -> ``inputs[0].datatype`` (the path a client wrote)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error_to_api_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming the offending field."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {detail}".rstrip(": "), param="body",
                        code="invalid_json")
    param = field_path(first.get("loc", ())) or "body"
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = "field required"
    elif first.get("type") == "extra_forbidden":
        message = "unknown field"
    suffix = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return APIError(400, f"{param}: {message}{suffix}", param=param, code="invalid_value")


def install_error_handling(app: FastAPI, render: ErrorRenderer, *, max_body_bytes: int) -> None:
    """Route every failure of ``app`` through ``render`` and cap request bodies at ``max_body_bytes``."""

    async def on_api_error(_: Request, exc: APIError) -> Response:
        return render(exc)

    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return render(validation_error_to_api_error(exc.errors()))

    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> Response:
        return render(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return render(APIError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes, render=render)


class BodySizeLimitMiddleware:
    """Refuses request bodies over ``max_body_bytes`` with 413, by header or while reading.

    The body is read (up to the limit) before the app sees it, and replayed to the app: every route
    buffers whole JSON bodies anyway, and a refusal must not depend on how the route parses.
    """

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, render: ErrorRenderer) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes
        chunks: list[bytes] = []
        received = 0
        while not too_large:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            too_large = received > self.max_body_bytes
            if not message.get("more_body", False):
                break
        if too_large:
            error = APIError(413, f"request body exceeds {self.max_body_bytes} bytes", param="body",
                             code="body_too_large")
            await self.render(error)(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
