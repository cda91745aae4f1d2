"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

# status -> OpenAI's error type
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request answered with an error instead of a completion.

    status:  HTTP status (400 unreadable or unsupported, 401 key, 404 model or path, 413 too large,
             422 invalid field, 429 queue full, 500 decoding failed)
    message: what was wrong, naming the field, what was expected and what came
    param:   the request field at fault, or None
    code:    a short machine-readable reason (e.g. "context_length_exceeded"), or None
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {...}} for an HTTP status."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
