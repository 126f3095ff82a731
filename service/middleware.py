"""Small ASGI middlewares, each one concern: request metrics, the API key, admission, the body-size
limit.

They act before FastAPI reads a body, so an unauthenticated, unadmittable or
oversized upload is refused without being read.
"""

from __future__ import annotations

import hmac
import json
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from service.engine import Ticket
from service.errors import ApiError
from service.metrics import INFERENCE_ROUTES, Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# the API key guards these; health, readiness and metrics stay open for probes and scrapers
PROTECTED_ROUTES = INFERENCE_ROUTES | {"/models", "/tasks"}
ROUTES = INFERENCE_ROUTES | {
    "/models",
    "/tasks",
    "/healthz",
    "/readyz",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/",
}


def endpoint_label(scope: Scope) -> str:
    """The route as a bounded metric label: a known path, else ``other``."""
    path = scope.get("path", "")
    return path if path in ROUTES else "other"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(send: Send, status: int, error: str, detail: str, headers: dict[str, str]) -> None:
    body = json.dumps({"error": error, "detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


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
    """When a key is configured, ``PROTECTED_ROUTES`` need ``Authorization: Bearer KEY`` or
    ``X-API-Key: KEY`` (compared in constant time); other routes stay open."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key is not None and scope.get("path") in PROTECTED_ROUTES:
            supplied = _header(scope, b"x-api-key")
            auth = _header(scope, b"authorization")
            if supplied is None and auth is not None:
                scheme, _, token = auth.partition(" ")
                supplied = token.strip() if scheme.lower() == "bearer" else None
            if supplied is None or not hmac.compare_digest(supplied.encode(), self.key):
                what = "missing" if supplied is None else "wrong"
                await _send_error(
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
            await _send_error(send, err.status_code, err.error, str(err.detail), dict(err.headers or {}))
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
                await _send_error(send, 400, "bad_request", "invalid Content-Length", {"Connection": "close"})
                return
            if int(declared) > self.max_bytes:
                self.metrics.rejected.labels("body_too_large").inc()
                await _send_error(send, 413, "payload_too_large", self._detail(), {"Connection": "close"})
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
