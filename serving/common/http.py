"""HTTP plumbing shared by the OpenAI-style and the OIP v2 APIs.

Each API renders errors in its own wire shape; what counts as an error, which status it gets, which
request field it names and how the OpenAPI schemas document it is decided here once, so both APIs
behave the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.common.errors import APIError, body_too_large, internal_error
from serving.common.logging import get_logger

logger = get_logger("http")


ErrorRenderer = Callable[[APIError], Response]


def app_state(name: str) -> Callable[[Request], Any]:
    """A FastAPI dependency answering ``request.app.state.<name>``: what the app's builder put there."""

    async def from_state(request: Request) -> Any:  # async: FastAPI runs a sync dependency in a thread
        return getattr(request.app.state, name)

    return from_state


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


#: What each error status means, as the OpenAPI schemas document it.
_ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON (or nested too deeply), a missing, unknown or invalid field, or a value "
         "beyond a configured limit; the error names the field at fault.",
    401: "Missing or wrong API key: send `Authorization: Bearer <key>`.",
    404: "The named model (or model version, LoRA, ControlNet) does not exist.",
    413: "Request too large: a body over the configured `max_body_bytes`, or more rows than allowed.",
    422: "Well formed, but a named resource cannot be used (a LoRA file that fails to load).",
    503: "Temporarily unable to serve (overloaded, or a dependency is unavailable); retry after `Retry-After` seconds.",
}
_ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"description": "`Bearer`, with `error=\"invalid_token\"` for a wrong key.",
                               "required": True, "schema": {"type": "string"}}},
    503: {"Retry-After": {"description": "Seconds to wait before retrying.", "required": True,
                          "schema": {"type": "integer", "minimum": 0}}},
}


def error_responses(model: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of a route for the error ``statuses`` it can answer, in the API's error ``model``."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        responses[status] = {"model": model, "description": _ERROR_DESCRIPTIONS[status]}
        if status in _ERROR_HEADERS:
            responses[status]["headers"] = _ERROR_HEADERS[status]
    return responses


def edit_openapi(app: FastAPI, edit: Callable[[dict[str, Any]], None]) -> None:
    """Applies ``edit`` to ``app``'s OpenAPI schema once, when it is first generated."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            edit(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_validation_error_responses(schema: dict[str, Any]) -> None:
    """FastAPI documents a 422 ``HTTPValidationError`` on every route with parameters; here those are 400s."""
    generated = {"$ref": "#/components/schemas/HTTPValidationError"}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema") == generated:
                del responses["422"]
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)


class _JSONRequest(Request):
    """Parses JSON bodies with pydantic's parser: nesting past its depth limit, or bytes that are not UTF-8, are
    a JSON decode error (so a 400 naming the body) instead of whatever ``json.loads`` would raise."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = pydantic_core.from_json(await self.body())
            except ValueError as error:
                raise json.JSONDecodeError(str(error), "", 0) from None
        return self._json


class JSONRoute(APIRoute):
    """Route class parsing JSON bodies with pydantic's parser (``_JSONRequest``); an ``APIRouter`` included into an
    app needs it as its own ``route_class`` (routers keep theirs)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handle = super().get_route_handler()

        async def handle_json(request: Request) -> Response:
            return await handle(_JSONRequest(request.scope, request.receive))

        return handle_json


def install_error_handling(app: FastAPI, render: ErrorRenderer, *, max_body_bytes: int) -> None:
    """Route every failure of ``app`` through ``render``, cap request bodies at ``max_body_bytes`` and parse JSON
    bodies of routes added to ``app`` afterwards with pydantic's parser (included routers: ``JSONRoute``); the
    OpenAPI schema shows validation errors as 400s."""

    async def on_api_error(_: Request, exc: APIError) -> Response:
        return render(exc)

    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return render(validation_error_to_api_error(exc.errors()))

    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> Response:
        return render(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return render(internal_error())

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes, render=render)
    app.router.route_class = JSONRoute
    edit_openapi(app, _drop_validation_error_responses)


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
            error = body_too_large(self.max_body_bytes)
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
