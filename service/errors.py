"""Every error the API returns, as JSON ``{"error": code, "detail": message, "request_id": id}``.

A client's mistake maps to a 4xx with a detail saying what was wrong; only a
bug in the service is a 500.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kdeq.service")


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: str
    detail: str
    request_id: str | None = Field(
        None, description="the request's ID, as in the `X-Request-ID` header: quote it when reporting"
    )


class ApiError(StarletteHTTPException):
    """An error response: ``status``, a short machine-readable ``error`` code and a ``detail``.

    A subclass of Starlette's ``HTTPException`` so that FastAPI re-raises it
    unchanged when it happens while the request body is being read.
    """

    def __init__(self, status: int, error: str, detail: str, headers: dict[str, str] | None = None):
        super().__init__(status_code=status, detail=detail, headers=headers)
        self.error = error


class DeviceFailedError(ApiError):
    """503 ``device_failed``: ``device`` hit a sticky error (``reason``), after which nothing more
    can run on it in this process; the engine retires the device and the process exits to be
    restarted."""

    def __init__(self, device: str, reason: str) -> None:
        detail = f"{device} failed and this replica is restarting; retry on another: {reason}"
        super().__init__(503, "device_failed", detail, {"Retry-After": "5"})
        self.device = device
        self.reason = reason


STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "unprocessable",
    503: "unavailable",
    504: "timeout",
}

# pydantic error types that mean "could not be read" (400) rather than "out of range" (422)
MALFORMED = ("missing", "parsing", "_type", "json_invalid")
# a file field sent as text is malformed, whatever pydantic calls the error
FILE_FIELDS = ("image", "mask")

ERROR_RESPONSES: dict[int | str, dict] = {
    400: {
        "model": ErrorBody,
        "description": "malformed request: a missing, duplicated, unknown or "
        "unparsable field, or an empty file",
    },
    401: {"model": ErrorBody, "description": "API key missing or wrong (only when one is configured)"},
    404: {"model": ErrorBody, "description": "no loaded model of this task by that name"},
    413: {"model": ErrorBody, "description": "body over the byte limit, or image over the pixel limit"},
    415: {"model": ErrorBody, "description": "not a decodable PNG, JPEG, WebP or TIFF image"},
    422: {
        "model": ErrorBody,
        "description": "a value out of range, mask and image sizes differ, or an uncertainty map "
        "that cannot be given",
    },
    503: {
        "model": ErrorBody,
        "description": "not ready, draining, queue full, out of memory or device failed; see `Retry-After`",
    },
    504: {"model": ErrorBody, "description": "no result within the request timeout"},
}


def request_id_of(scope: MutableMapping[str, Any]) -> str | None:
    """The ID the ``RequestId`` middleware gave the request of ``scope`` (``None`` before it ran)."""
    return scope.get("state", {}).get("kdeq_request_id")


def error_response(
    request: Request, status: int, error: str, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The JSON error ``{"error", "detail", "request_id"}``, the ID in ``X-Request-ID`` too: a 500
    is sent from outside the middlewares, past the one that adds the header."""
    rid = request_id_of(request.scope)
    if rid is not None:
        headers = {**(headers or {}), "X-Request-ID": rid}
    body = {"error": error, "detail": detail, "request_id": rid}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_status(err: RequestValidationError) -> int:
    for e in err.errors():
        loc = e.get("loc", ())
        if any(m in e.get("type", "") for m in MALFORMED) or (loc and loc[-1] in FILE_FIELDS):
            return 400
    return 422


def _describe(err: RequestValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body", "query"))
        parts.append(f"{where}: {e.get('msg', 'invalid')}" if where else e.get("msg", "invalid"))
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to the JSON error format."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = getattr(exc, "error", STATUS_CODES.get(exc.status_code, "error"))
        return error_response(request, exc.status_code, error, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        status = _validation_status(exc)
        return error_response(request, status, STATUS_CODES[status], _describe(exc))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id_of(request.scope)
        log.exception("unhandled error on %s %s", request.method, request.url.path, extra={"request_id": rid})
        return error_response(request, 500, "internal", "internal error; the service log has the details")
