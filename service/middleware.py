"""Small ASGI middlewares, each one concern: the request ID, the access log, request metrics, the
API key, admission, the body-size limit.

They act before FastAPI reads a body, so an unauthenticated, unadmittable or
oversized upload is refused without being read.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from service.engine import Ticket
from service.errors import ApiError, request_id_of
from service.logs import REQUEST_ID, access_log
from service.metrics import INFERENCE_ROUTES, Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# the API key guards these and every route under /models/; health, readiness and metrics stay open
# for probes and scrapers
PROTECTED_ROUTES = INFERENCE_ROUTES | {"/models", "/tasks"}
MODEL_ROUTE = re.compile(r"^/models/[^/]+(/load|/unload|/ready)?$")
ROUTES = INFERENCE_ROUTES | {
    "/models",
    "/tasks",
    "/healthz",
    "/readyz",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/favicon.ico",
    "/",
}


def endpoint_label(scope: Scope) -> str:
    """The route as a bounded metric label: a known path, else ``other``."""
    path = scope.get("path", "")
    if path in ROUTES:
        return path
    model = MODEL_ROUTE.match(path)
    return "/models/{name}" + (model.group(1) or "") if model else "other"


def protected(path: str) -> bool:
    """Whether the API key guards ``path``."""
    return path in PROTECTED_ROUTES or path.startswith("/models/")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(
    scope: Scope, send: Send, status: int, error: str, detail: str, headers: dict[str, str]
) -> None:
    body = json.dumps({"error": error, "detail": detail, "request_id": request_id_of(scope)}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


#: an ``X-Request-ID`` a client may choose: 1 to 128 printable ASCII characters, no spaces
CLIENT_REQUEST_ID = re.compile(r"[!-~]{1,128}")


def request_id(supplied: str | None) -> str:
    """The client's ``X-Request-ID`` when it is ``CLIENT_REQUEST_ID``, else a new random one (32 hex
    digits): an ID that could break a log line or a header is replaced, never passed on."""
    if supplied is not None and CLIENT_REQUEST_ID.fullmatch(supplied):
        return supplied
    return uuid.uuid4().hex


class RequestId:
    """Gives every request an ID (``request_id``), in ``scope["state"]["kdeq_request_id"]`` and in
    ``logs.REQUEST_ID`` for its context, and returns it in the ``X-Request-ID`` header of every
    response, errors and refusals included; the error bodies carry it too (``errors``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(_header(scope, b"x-request-id"))
        scope.setdefault("state", {})["kdeq_request_id"] = rid
        token = REQUEST_ID.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message["headers"] = [*headers, (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


#: routes that probes and scrapers call every few seconds: their lines are at DEBUG, not INFO
QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})


def _number(value: str) -> float | str:
    """A header's number as a float, or the text when JSON has no such number (``inf``, ``nan``)."""
    try:
        number = float(value)
    except ValueError:
        return value
    return number if math.isfinite(number) else value


#: the response headers whose values the access line carries: field, header, the value's type
SOLVE_HEADERS: dict[str, tuple[bytes, Callable[[str], object]]] = {
    "model": (b"x-kdeq-model", str),
    "iterations": (b"x-kdeq-iterations", int),
    "residual": (b"x-kdeq-residual", _number),
    "converged": (b"x-kdeq-converged", lambda v: v == "true"),
    "batch_size": (b"x-kdeq-batch-size", int),
}
#: an error body is read for its ``error`` code up to this many bytes
ERROR_PEEK = 4096


def _server_timing(value: str) -> dict[str, float]:
    """``{"decode_ms": 1.2, ...}`` from ``Server-Timing: decode;dur=1.2, queue;dur=...``."""
    out = {}
    for metric in value.split(","):
        name, _, params = metric.strip().partition(";")
        if params.startswith("dur="):
            try:
                out[f"{name}_ms"] = float(params[4:])
            except ValueError:
                continue
    return out


class AccessLog:
    """One line per request on logger ``kdeq.access`` when its response has been sent: method, route,
    status, bytes in and out, milliseconds, the client's address, and, from the response's headers,
    the model, iterations, residual, convergence, batch size and the ``Server-Timing`` phases
    (decode, queue, inference, encode); an error's ``error`` code from its JSON body. Nothing else of
    a request — headers, key, image — is logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        fields: dict[str, object] = {"status": 500, "bytes_in": 0, "bytes_out": 0}
        peek = bytearray()

        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                fields["bytes_in"] += len(message.get("body", b""))
            return message

        async def observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                fields["status"] = message["status"]
                headers = {k.lower(): v.decode("latin-1") for k, v in message.get("headers", ())}
                for name, (header, kind) in SOLVE_HEADERS.items():
                    if header in headers:
                        with contextlib.suppress(ValueError):
                            fields[name] = kind(headers[header])
                fields.update(_server_timing(headers.get(b"server-timing", "")))
                fields["json_error"] = message["status"] >= 400 and headers.get(
                    b"content-type", ""
                ).startswith("application/json")
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                fields["bytes_out"] += len(body)
                if fields.get("json_error") and len(peek) < ERROR_PEEK:
                    peek.extend(body[: ERROR_PEEK - len(peek)])
            await send(message)

        try:
            await self.app(scope, counted, observed)
        finally:
            path = scope.get("path", "")[:256]
            entry: dict[str, object] = {
                "method": scope.get("method"),
                "route": path,
                "status": fields.pop("status"),
                "error": _error_code(bytes(peek)) if fields.pop("json_error", False) else None,
                "ms": round((time.perf_counter() - start) * 1e3, 1),
                "client": (scope.get("client") or ("",))[0] or None,
                **fields,
            }
            level = logging.DEBUG if path in QUIET_ROUTES else logging.INFO
            access_log.log(level, "%s %s %s", entry["method"], path, entry["status"], extra={"access": entry})


def _error_code(body: bytes) -> str | None:
    """The ``error`` of a JSON error body (``None`` if it is cut short or not one)."""
    try:
        value = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class RequestMetrics:
    """Counts every response by endpoint and status, times it, and tracks inference requests in flight."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope)
        inference = endpoint in INFERENCE_ROUTES
        status = 500
        start = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if inference:
            self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            if inference:
                self.metrics.in_flight.dec()
            self.metrics.http_requests.labels(endpoint, str(status)).inc()
            self.metrics.http_duration.labels(endpoint).observe(time.perf_counter() - start)


class ApiKey:
    """When a key is configured, the ``protected`` routes need ``Authorization: Bearer KEY`` or
    ``X-API-Key: KEY`` (compared in constant time); other routes stay open."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key is not None and protected(scope.get("path", "")):
            supplied = _header(scope, b"x-api-key")
            auth = _header(scope, b"authorization")
            if supplied is None and auth is not None:
                scheme, _, token = auth.partition(" ")
                supplied = token.strip() if scheme.lower() == "bearer" else None
            if supplied is None or not hmac.compare_digest(supplied.encode(), self.key):
                what = "missing" if supplied is None else "wrong"
                await _send_error(
                    scope,
                    send,
                    401,
                    "unauthorized",
                    f"API key {what}: send `Authorization: Bearer KEY` or `X-API-Key: KEY`",
                    {"WWW-Authenticate": 'Bearer realm="kdeq"'},
                )
                return
        await self.app(scope, receive, send)


class Admission:
    """Admits an inference request at arrival, before its upload is read, or refuses it at once with
    503 and ``Retry-After`` (engine not running or stopping, queue full counting the requests already
    admitted). The admission ``Ticket`` is ``scope["state"]["kdeq_ticket"]`` for the route; its place
    is given back when the request ends without reaching the queue."""

    def __init__(self, app: ASGIApp, admit: Callable[[], Ticket], release: Callable[[Ticket], None]) -> None:
        self.app = app
        self.admit = admit
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in INFERENCE_ROUTES or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            ticket = self.admit()
        except ApiError as err:
            headers = dict(err.headers or {})
            await _send_error(scope, send, err.status_code, err.error, str(err.detail), headers)
            return
        scope.setdefault("state", {})["kdeq_ticket"] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            self.release(ticket)


class BodyLimit:
    """Refuses a body over ``max_bytes`` with 413: at once from ``Content-Length``, else while reading
    (chunked uploads), before any parsing; records the body size of inference requests."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope)
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not re.fullmatch(r"[0-9]{1,18}", declared.strip()):
                await _send_error(
                    scope, send, 400, "bad_request", "invalid Content-Length", {"Connection": "close"}
                )
                return
            if int(declared) > self.max_bytes:
                self.metrics.rejected.labels("body_too_large").inc()
                await _send_error(
                    scope, send, 413, "payload_too_large", self._detail(), {"Connection": "close"}
                )
                return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    self.metrics.rejected.labels("body_too_large").inc()
                    raise ApiError(413, "payload_too_large", self._detail(), {"Connection": "close"})
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if endpoint in INFERENCE_ROUTES:
                self.metrics.upload_size.labels(endpoint).observe(received)

    def _detail(self) -> str:
        return f"the request body is over the limit of {self.max_bytes} bytes"
