"""OpenAI-style errors: one exception type the handlers raise and one JSON body shape.

Every non-2xx answer of the API carries ``{"error": {"message", "type", "param", "code"}}``;
``param`` names the offending request field (``messages[1].role``) when there is one.
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

# HTTP status -> OpenAI error type (the ``type`` field of the body).
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    409: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """A request the server answers with an error. Raised by validation and by the handlers;
    turned into a JSON response by the error middleware or into an SSE error event mid-stream."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def kind(self) -> str:
        """Label for ``tetri_request_errors_total{kind}``."""
        return self.code or _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, param=self.param, code=self.code)


def error_body(
    message: str, status: int, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    err_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


def bad_param(param: str, message: str) -> APIError:
    """400 naming ``param``; the message is prefixed with the field so it reads on its own."""
    return APIError(f"{param}: {message}", param=param, code="invalid_parameter")


def queue_full(retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(
        "the server is at its queue limit; retry later",
        status=429,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


def timeout_error(timeout_s: float) -> APIError:
    return APIError(
        f"the request did not finish within the server's limit of {timeout_s:g} s",
        status=504,
        code="timeout",
    )


def request_too_large(reason: str) -> APIError:
    return APIError(reason, status=413, code="request_too_large")


def worker_unavailable(reason: str, retry_after_s: float) -> APIError:
    """No worker could take the request in time (restarting): retrying later may work."""
    return APIError(f"service unavailable: {reason}", status=503, code="service_unavailable",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def generation_failed(reason: str) -> APIError:
    return APIError(f"generation failed: {reason}", status=500, code="generation_failed")
