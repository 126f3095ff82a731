"""OpenTelemetry traces of the requests (the optional extra ``otel``).

Off unless the OpenTelemetry SDK is installed (``pip install 'kdeq[otel]'``) and
``OTEL_TRACES_EXPORTER`` names an exporter: ``otlp`` (OTLP over HTTP) or ``console``. The rest is
the standard ``OTEL_*`` configuration, read by the SDK: ``OTEL_SERVICE_NAME`` (default ``kdeq``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` and its kin, ``OTEL_TRACES_SAMPLER``,
``OTEL_SDK_DISABLED``. Off, the API's no-op tracer costs a call per request and nothing per solve.

FastAPI makes each request a server span ``METHOD /route`` (``http.*`` attributes, the status),
the child of the caller's ``traceparent`` when it sends one, with its endpoint's span inside. A
solve adds four children to that, at the times the route measured them: ``decode``, ``queue``,
``solve`` (model, iterations, residual, convergence, batch size, request ID) and ``encode``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence

from opentelemetry import trace

from service.logs import REQUEST_ID

log = logging.getLogger("kdeq.service")

tracer = trace.get_tracer("kdeq.service")


def configure() -> str | None:
    """Install the SDK's tracer provider, exporting through ``OTEL_TRACES_EXPORTER``'s exporter in
    batches; that exporter's name, or ``None`` when tracing stays off (and why is logged)."""
    name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if name in ("", "none") or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=%s, but the OpenTelemetry SDK is not installed: no traces", name)
        return None
    exporter: SpanExporter
    if name == "console":
        exporter = ConsoleSpanExporter()
    elif name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_TRACES_EXPORTER=otlp, but its exporter is not installed: no traces")
            return None
        exporter = OTLPSpanExporter()
    else:
        log.warning("OTEL_TRACES_EXPORTER=%s is not one of otlp, console, none: no traces", name)
        return None
    service = os.environ.get("OTEL_SERVICE_NAME") or "kdeq"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing: %s exporter, service.name %s", name, service)
    return name


def record_phases(phases: Sequence[tuple[str, float, float]], solve: Mapping[str, object]) -> None:
    """Children of the current span for a request's phases, each ``(name, start, end)`` in
    ``time.monotonic`` seconds; ``solve``'s attributes go on the span named ``solve``. Nothing is
    built when the current span is not recording (no SDK, or not sampled)."""
    if not trace.get_current_span().is_recording():
        return
    offset = time.time_ns() - time.monotonic_ns()  # span times are wall-clock nanoseconds
    for name, start, end in phases:
        span = tracer.start_span(name, start_time=offset + int(start * 1e9))
        if name == "solve":
            span.set_attributes({f"kdeq.{k}": v for k, v in solve.items()})
            span.set_attribute("kdeq.request_id", REQUEST_ID.get() or "")
        span.end(end_time=offset + int(end * 1e9))
