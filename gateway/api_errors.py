"""Errors of the OpenAI HTTP API: an HTTP status and OpenAI's body shape,
`{"error": {"message", "type", "param", "code"}}`, and the checks the body parsers share (a field's type,
a number in range, UTF-8 text). Pure: no web framework here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class ApiError(Exception):
    """An error the client is shown as is; raise one of the constructors below."""

    def __init__(
        self, status: int, message: str, error_type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by value (a body parsed in a child process)
        return ApiError, (self.status, self.message, self.error_type, self.param, self.code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request can never succeed as sent."""
    return ApiError(400, message, "invalid_request_error", param, code)


def unsupported(field: str, why: str = "") -> ApiError:
    """400 for a field this server does not implement: refused, never silently ignored."""
    detail = f": {why}" if why else ""
    return bad_request(
        f"'{field}' is not supported by this server{detail}; remove it from the request", field, "unsupported_parameter"
    )


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server's limit of {max_bytes} bytes",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def overloaded(message: str) -> ApiError:
    """429: every worker's queue is full; the same request may succeed later."""
    return ApiError(429, message, "rate_limit_error", None, "queue_full")


def unavailable(message: str) -> ApiError:
    """503: no worker can serve now (none ready, or each one failed)."""
    return ApiError(503, message, "server_error", None, "service_unavailable")


def upstream_failed(message: str) -> ApiError:
    """502-like failure after generation began; OpenAI clients treat any 5xx as retryable, so 503."""
    return ApiError(503, message, "server_error", None, "worker_failed")


def wrong_type(name: str, expected: str, value: Any) -> ApiError:
    """400: field `name` holds a value of the wrong type."""
    return bad_request(f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.60}", name, "invalid_type")


def utf8_text(value: str, name: str) -> str:
    """`value`, refused when it cannot be UTF-8 (a lone surrogate, which JSON's \\ud800 escapes let in)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"'{name}' holds a lone surrogate ({value[exc.start]!r} at index {exc.start}), which is not text;"
            " send valid UTF-8",
            name,
            "invalid_value",
        ) from None
    return value


def number_field(body: Mapping[str, Any], name: str, low: float, high: float, low_open: bool = False) -> float | None:
    """Field `name` of `body` as a float in [low, high] (or (low, high] with `low_open`); None when absent or
    null; a 400 naming it otherwise."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise wrong_type(name, "a number", value)
    if value < low or value > high or (low_open and value == low):
        where = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise bad_request(f"'{name}' must be in {where}, got {value}", name, "invalid_value")
    return float(value)
