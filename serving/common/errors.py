"""Errors answered to the client. Each carries its HTTP status, message, code and headers, so one handler renders
any of them however deep it was raised; pickled, each arrives as a plain ``APIError`` with the same fields."""

from __future__ import annotations

import math
from collections.abc import Sequence


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

    def __reduce__(self):  # crosses Serve replicas as a plain APIError, whatever a subclass's constructor takes
        return (_rebuild_api_error, (self.status_code, self.message, self.param, self.code, self.headers))


def internal_error() -> APIError:
    """What a client is told of an error the code did not expect (the error itself is only logged)."""
    return APIError(500, "internal server error", code="internal_error")


def body_too_large(max_bytes: int) -> APIError:
    """The 413 of a request body over ``max_bytes`` (an HTTP body, or a gRPC message)."""
    return APIError(413, f"request body exceeds {max_bytes} bytes", param="body", code="body_too_large")


def _rebuild_api_error(status_code: int, message: str, param: str | None, code: str | None,
                       headers: dict[str, str] | None) -> APIError:
    return APIError(status_code, message, param=param, code=code, headers=headers)


class RequestItemError(APIError):
    """An error about an item the request names in its list ``field`` (``loras``, ``controlnets``); ``param`` is
    the list itself until ``located`` finds the item in a request."""

    def __init__(self, status_code: int, message: str, *, field: str, name: str, code: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code, message, param=field, code=code, headers=headers)
        self.field = field
        self.name = name

    def located(self, names: Sequence[str]) -> APIError:
        """The answer to a request whose ``field`` lists ``names``: ``param`` is where it first names the item
        (``loras[2].name``), or the list when it does not."""
        param = f"{self.field}[{names.index(self.name)}].name" if self.name in names else self.field
        return APIError(self.status_code, self.message, param=param, code=self.code, headers=self.headers)


def retry_after(seconds: float) -> dict[str, str]:
    """The ``Retry-After`` header of a temporary refusal: whole seconds, at least one."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}
