"""Every error the API returns, as JSON ``{"error": code, "detail": message, "request_id": id}``.

A client's mistake maps to a 4xx with a detail saying what was wrong; only a
bug in the service is a 500.
"""

from __future__ import annotations

import logging
import re
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request, params
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
#: the form a route taking files is sent as; anything else cannot carry a file
MULTIPART = "multipart/form-data"
#: how much of a value sent back in an error's detail is quoted
QUOTED = 40

ERROR_RESPONSES: dict[int | str, dict] = {
    400: {
        "model": ErrorBody,
        "description": "malformed request: a missing, duplicated, unknown or "
        "unparsable field, a text value where a file upload is expected, or an empty file",
    },
    401: {"model": ErrorBody, "description": "API key missing or wrong (only when one is configured)"},
    404: {"model": ErrorBody, "description": "no loaded model of this task by that name"},
    413: {"model": ErrorBody, "description": "body over the byte limit, or image over the pixel limit"},
    415: {
        "model": ErrorBody,
        "description": "`multipart_expected`: the body is not a multipart form (send "
        "`curl -F image=@photo.png URL`); otherwise not a decodable PNG, JPEG, WebP or TIFF image",
    },
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


def form_fields(request: Request) -> tuple[bool, frozenset[str]]:
    """Whether the route ``request`` matched takes a form, and the names of its file fields (both
    read from the route's parameters, so that every route and field is covered as it is declared)."""
    route = request.scope.get("route")
    body = getattr(route, "body_field", None)
    if body is None or not isinstance(body.field_info, params.Form):
        return False, frozenset()
    dependant = route.dependant
    files = {f.alias for f in dependant.body_params if isinstance(f.field_info, params.File)}
    return True, frozenset(files)


def _quoted(value: object) -> str:
    text = repr(value)
    return text if len(text) <= QUOTED else text[: QUOTED - 1] + "…"


def form_refusal(request: Request) -> ApiError | None:
    """415 ``multipart_expected`` for a request to a route taking a form whose body cannot be one:
    a ``Content-Type`` other than ``multipart/form-data`` (a raw image, a URL-encoded form, JSON, none
    at all), or one without its ``boundary``. ``None`` for a multipart request, or a route without
    a form."""
    takes_form, files = form_fields(request)
    if not takes_form:
        return None
    sent = request.headers.get("content-type", "")
    kind, _, parameters = sent.partition(";")
    has_boundary = re.search(r"(?:^|;)\s*boundary\s*=\s*[^\s;]", parameters, re.IGNORECASE)
    if kind.strip().lower() == MULTIPART and has_boundary:
        return None
    what = f"Content-Type {sent.strip()!r}" if sent.strip() else "no Content-Type"
    if kind.strip().lower() == MULTIPART:
        what = "a multipart Content-Type without its boundary"
    field = "image" if "image" in files else min(files, default="image")
    url = str(request.base_url).rstrip("/") + request.url.path
    detail = (
        f"this route takes a multipart form ({MULTIPART}) with the image as the file field "
        f"`{field}`, e.g. `curl -F {field}=@photo.png {url}`; the request had {what}"
    )
    return ApiError(415, "multipart_expected", detail)


def _bound(kind: str, ctx: dict) -> str | None:
    """``> 0``, ``≤ 1`` … for a pydantic range error's ``kind`` and context, else ``None``."""
    for key, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
        if key in ctx and kind.startswith(("greater", "less")):
            return f"{sign} {ctx[key]}"
    return None


def describe_error(error: dict, files: frozenset[str] = frozenset()) -> str:
    """One pydantic error ``{"type", "loc", "msg", "input", "ctx"}`` in the service's words: the field
    by its name and what its value must be (a file upload, a number, one of the choices …)."""
    kind = error.get("type", "")
    ctx = error.get("ctx") or {}
    loc = [p for p in error.get("loc", ()) if p not in ("body", "query", "path", "header")]
    name = str(loc[-1]) if loc and isinstance(loc[-1], str) else None
    got = f", got {_quoted(error['input'])}" if "input" in error and kind != "missing" else ""
    if kind == "json_invalid":
        return "the body is not valid JSON"
    if name is None:
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return "the body must be a JSON object"
        return _message(error)
    field = f"`{name}`"
    if name in files:
        if kind == "missing":
            return f"no {field} file in the form: send it as a file upload, e.g. `curl -F {name}=@FILE`"
        return f"{field} must be a file upload (`-F {name}=@FILE`), not a text value"
    bound = _bound(kind, ctx)
    if bound is not None:
        return f"{field} must be {bound}{got}"
    described = {
        "missing": f"{field} is required",
        "int_parsing": f"{field} must be a whole number{got}",
        "int_from_float": f"{field} must be a whole number{got}",
        "float_parsing": f"{field} must be a number{got}",
        "finite_number": f"{field} must be a finite number{got}",
        "bool_parsing": f"{field} must be true or false{got}",
        "literal_error": f"{field} must be {ctx.get('expected', 'one of the choices')}{got}",
        "enum": f"{field} must be {ctx.get('expected', 'one of the choices')}{got}",
        "string_too_long": f"{field} must be at most {ctx.get('max_length')} characters",
        "extra_forbidden": f"unknown field {field}",
    }
    return described.get(kind, f"{field}: {_message(error)}")


def _message(error: dict) -> str:
    """pydantic's own message, without the ``Value error, `` it puts before a validator's."""
    if error.get("type") == "value_error" and "error" in (error.get("ctx") or {}):
        return str(error["ctx"]["error"])
    return str(error.get("msg", "invalid"))


def describe_errors(errors: list[dict], files: frozenset[str] = frozenset()) -> str:
    """Every error of a pydantic validation (``describe_error``), joined by ``; ``."""
    return "; ".join(dict.fromkeys(describe_error(e, files) for e in errors))


def validation_status(errors: list[dict], files: frozenset[str] = frozenset()) -> int:
    """400 where a value could not be read (missing, unparsable, text for a file), else 422 (read but
    out of range)."""
    for e in errors:
        loc = e.get("loc", ())
        if any(m in e.get("type", "") for m in MALFORMED) or (loc and loc[-1] in files):
            return 400
    return 422


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to the JSON error format."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # a form route's 400s and 422s (FastAPI's "Missing boundary", an unknown field) are, for a
        # body that is no multipart form, that one mistake; a 413 or a 401 stays what it is
        refusal = form_refusal(request) if exc.status_code in (400, 422) else None
        if refusal is not None:
            exc = refusal
        error = getattr(exc, "error", STATUS_CODES.get(exc.status_code, "error"))
        return error_response(request, exc.status_code, error, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        refusal = form_refusal(request)
        if refusal is not None:
            return error_response(request, 415, refusal.error, str(refusal.detail))
        _, files = form_fields(request)
        errors = list(exc.errors())
        status = validation_status(errors, files)
        return error_response(request, status, STATUS_CODES[status], describe_errors(errors, files))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id_of(request.scope)
        log.exception("unhandled error on %s %s", request.method, request.url.path, extra={"request_id": rid})
        return error_response(request, 500, "internal", "internal error; the service log has the details")
