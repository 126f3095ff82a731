"""The service's logs: one line per record, as text or as JSON (``KDEQ_LOG_FORMAT``), each carrying
the ID of the request it was written for.

``REQUEST_ID`` holds the current request's ID in the request's context (set by the ``RequestId``
middleware); every record logged in that context — by a route, an error handler, the access log —
gets it as ``request_id``. The access log (logger ``kdeq.access``) writes one line per request,
with its fields in ``record.access``: a JSON line has them as keys, a text line as ``key=value``.
Only the fields named in ``middleware.AccessLog`` are logged: never a header, a body or a key.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from typing import Literal

from opentelemetry import trace

REQUEST_ID: ContextVar[str | None] = ContextVar("kdeq_request_id", default=None)

access_log = logging.getLogger("kdeq.access")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RequestIdFilter(logging.Filter):
    """Gives every record the current request's ID (``None`` outside a request), and the current
    trace's ID (``trace_id``, 32 hex digits) while a span is recording (``service.tracing``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        context = trace.get_current_span().get_span_context()
        if context.is_valid and not hasattr(record, "trace_id"):
            record.trace_id = format(context.trace_id, "032x")
        return True


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, then the access fields as ``key=value`` and the request ID where there is one."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = dict(getattr(record, "access", None) or {})
        request_id = getattr(record, "request_id", None)
        if request_id is not None and "request_id" not in fields:
            fields = {"request_id": request_id, **fields}
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return f"{line} {extra}" if extra else line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    ``request_id``, the access fields, and ``exception`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        if hasattr(record, "trace_id"):
            entry["trace_id"] = record.trace_id
        entry.update(getattr(record, "access", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str, form: Literal["text", "json"]) -> None:
    """Send every logger's records (uvicorn's too: it is given no handlers of its own) to standard
    error, one line each in ``form``, at ``level`` and above."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if form == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
