"""OpenTelemetry traces (issue 24, item 3): a solve's phases inside the request's span, recorded by
the SDK's in-memory exporter, the caller's trace continued, the trace's ID in the log lines, and the
exporter chosen by the standard variables."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service import tracing
from service.app import create_app
from service.logs import JsonFormatter, RequestIdFilter
from service.settings import Settings
from tests.service_helpers import encode, noisy, smooth_image, to_uint8

sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the OpenTelemetry SDK (the otel extra)")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """A tracer provider for this process recording into memory (a process has one provider: the
    tests after these record too, into the same exporter, at the cost of a list append)."""
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    # a provider set once is the process's: the module's tracer, made before, now reaches it
    if not isinstance(trace.get_tracer_provider(), sdk.TracerProvider):
        pytest.skip("another tracer provider was set earlier in this process")
    return exporter


@pytest.fixture(scope="module")
def client(spans: InMemorySpanExporter) -> Iterator[TestClient]:
    settings = Settings(models_dir=MODELS, device=("cpu",), models=("denoise-kglm:2",), warmup=False)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        assert c.app.state.service.wait_loaded(120)
        yield c


def _ancestors(span, by_id: dict) -> list:
    """The span's parents up the recorded tree, nearest first."""
    out = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        out.append(span)
    return out


def test_a_solve_adds_its_four_phases_inside_the_request_span_of_the_callers_trace(
    client: TestClient, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    png = encode(to_uint8(noisy(smooth_image(40, 48), 25.0)))
    r = client.post(
        "/denoise",
        files={"image": ("a.png", png, "image/png")},
        headers={"traceparent": f"00-{TRACE}-{PARENT}-01", "X-Request-ID": "traced-1"},
    )
    assert r.status_code == 200
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    (server,) = [s for s in finished if s.kind == trace.SpanKind.SERVER]
    assert server.name == "POST /denoise" and server.attributes["http.response.status_code"] == 200
    assert (
        format(server.context.trace_id, "032x") == TRACE and format(server.parent.span_id, "016x") == PARENT
    )
    phases = [next(s for s in finished if s.name == name) for name in ("decode", "queue", "solve", "encode")]
    for phase in phases:
        assert server in _ancestors(phase, by_id), phase.name
        assert server.start_time <= phase.start_time <= phase.end_time <= server.end_time, phase.name
    for before, after in itertools.pairwise(phases):
        assert before.end_time <= after.start_time
    solve = phases[2].attributes
    assert solve["kdeq.request_id"] == "traced-1" == r.headers["x-request-id"]
    assert solve["kdeq.model"] == r.headers["x-kdeq-model"]
    assert solve["kdeq.iterations"] == int(r.headers["x-kdeq-iterations"])
    assert solve["kdeq.residual"] == pytest.approx(float(r.headers["x-kdeq-residual"]), rel=1e-3)
    assert solve["kdeq.converged"] is (r.headers["x-kdeq-converged"] == "true")
    assert solve["kdeq.batch_size"] == 1


def test_a_refused_request_starts_its_own_trace_and_solves_nothing(
    client: TestClient, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    r = client.post("/denoise", files={"image": ("a.png", b"not an image", "image/png")})
    assert r.status_code == 415
    (server,) = [s for s in spans.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert server.parent is None and server.attributes["http.response.status_code"] == 415
    assert not [s for s in spans.get_finished_spans() if s.name in ("decode", "solve")]


def test_a_log_line_written_in_a_traced_request_names_its_trace(
    client: TestClient, spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    png = encode(to_uint8(noisy(smooth_image(24, 24), 25.0)))
    caplog.handler.addFilter(RequestIdFilter())  # as the service's log handler has it
    with caplog.at_level(logging.INFO, logger="kdeq.access"):
        r = client.post(
            "/denoise",
            files={"image": ("a.png", png, "image/png")},
            headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
        )
    assert r.status_code == 200
    (line,) = [rec for rec in caplog.records if rec.name == "kdeq.access"]
    assert json.loads(JsonFormatter().format(line))["trace_id"] == TRACE


@pytest.mark.parametrize(
    "env, chosen",
    [
        ({}, None),
        ({"OTEL_TRACES_EXPORTER": "none"}, None),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, None),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "otlp"),
    ],
)
def test_the_standard_variables_choose_the_exporter(
    env: dict[str, str], chosen: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    installed = []
    monkeypatch.setattr(tracing.trace, "set_tracer_provider", installed.append)
    assert tracing.configure() == chosen
    assert len(installed) == (chosen is not None)
    if chosen is not None:
        (provider,) = installed
        assert provider.resource.attributes["service.name"] == "kdeq"
        provider.shutdown()
