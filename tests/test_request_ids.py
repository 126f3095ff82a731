"""Request IDs and the structured logs (issue 24, items 1 and 2): against a real server writing JSON
lines, and the pieces — ID validation, the formatters, the 500 path — on their own."""

from __future__ import annotations

import base64
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.errors import install_error_handlers
from service.logs import REQUEST_ID, JsonFormatter, RequestIdFilter, TextFormatter
from service.middleware import AccessLog, RequestId, _error_code, _server_timing, request_id
from tests.service_helpers import Server, assert_error, encode, noisy, run_server, smooth_image, to_uint8

KEY = "k3y-that-must-never-be-logged-7f2a"
HEX32 = re.compile(r"[0-9a-f]{32}")
MAX_UPLOAD = 200_000


@pytest.mark.parametrize(
    "supplied",
    ["abc-123", "x" * 128, "Z:/a_b.c~!", "0" * 32],
)
def test_a_valid_client_id_is_kept(supplied: str) -> None:
    assert request_id(supplied) == supplied


@pytest.mark.parametrize(
    "supplied",
    [None, "", "a b", "x" * 129, "café", "line\nbreak", "tab\t", "\x00", "del\x7f"],
)
def test_an_invalid_client_id_is_replaced_by_a_fresh_one(supplied: str | None) -> None:
    ids = {request_id(supplied) for _ in range(3)}
    assert len(ids) == 3 and all(HEX32.fullmatch(i) for i in ids)


def _record(message: str = "hello", **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("kdeq.test", logging.INFO, __file__, 1, message, (), None)
    for k, v in extra.items():
        setattr(record, k, v)
    return record


def test_every_record_in_a_request_context_carries_its_id() -> None:
    filt = RequestIdFilter()
    outside = _record()
    filt.filter(outside)
    token = REQUEST_ID.set("req-7")
    try:
        inside = _record()
        filt.filter(inside)
        explicit = _record(request_id="given")  # the 500 handler names it: kept
        filt.filter(explicit)
    finally:
        REQUEST_ID.reset(token)
    assert (outside.request_id, inside.request_id, explicit.request_id) == (None, "req-7", "given")


def test_the_json_formatter_writes_one_object_with_the_access_fields_and_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("POST /denoise 200", request_id="r1", access={"status": 200, "iterations": 3})
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "POST /denoise 200" and entry["level"] == "info"
    assert entry["request_id"] == "r1" and entry["status"] == 200 and entry["iterations"] == 3
    assert "ValueError: boom" in entry["exception"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"])


def test_the_text_formatter_appends_the_id_and_the_fields_as_key_value() -> None:
    line = TextFormatter().format(
        _record("POST /denoise 200", request_id="r1", access={"status": 200, "error": None, "model": "m:1"})
    )
    assert line.endswith("POST /denoise 200 request_id=r1 status=200 model=m:1"), line
    assert TextFormatter().format(_record("plain", request_id=None)).endswith("kdeq.test: plain")


def test_server_timing_and_error_codes_are_read_back() -> None:
    timing = _server_timing(
        "decode;dur=1.5, queue;dur=0.1, inference;dur=93.7, encode;dur=1.0, total;dur=96.3"
    )
    assert timing == {
        "decode_ms": 1.5,
        "queue_ms": 0.1,
        "inference_ms": 93.7,
        "encode_ms": 1.0,
        "total_ms": 96.3,
    }
    assert _server_timing("") == {} and _server_timing("x;desc=1, y;dur=oops") == {}
    assert _error_code(b'{"error": "queue_full", "detail": "d"}') == "queue_full"
    assert _error_code(b'{"error": "cut') is None and _error_code(b"[1]") is None


def test_an_unhandled_error_is_a_500_with_the_id_in_header_body_and_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    app.add_middleware(AccessLog)
    app.add_middleware(RequestId)
    with caplog.at_level(logging.INFO), TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/bug", headers={"X-Request-ID": "bug-report-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "bug-report-1"
    assert r.json() == {
        "error": "internal",
        "detail": "internal error; the service log has the details",
        "request_id": "bug-report-1",
    }
    errors = [rec for rec in caplog.records if rec.name == "kdeq.service"]
    assert errors and errors[0].request_id == "bug-report-1" and errors[0].exc_info is not None
    access = [rec for rec in caplog.records if rec.name == "kdeq.access"]
    assert [rec.access["status"] for rec in access] == [500]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("logs")
    settings = {"log_level": "info", "log_format": "json", "api_key": KEY, "max_upload_bytes": MAX_UPLOAD}
    with run_server(tmp, models="denoise-kglm:2", **settings) as running:
        yield running


def _lines(server: Server) -> list[dict]:
    """The server's log so far, each line parsed (a line that is not JSON fails the test)."""
    return [json.loads(line) for line in server.log.read_text().splitlines() if line.strip()]


def _access(server: Server, rid: str) -> dict:
    for _ in range(300):  # the line is written as the response ends: a moment after the client has it
        found = [e for e in _lines(server) if e["logger"] == "kdeq.access" and e["request_id"] == rid]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no access line for {rid}")


@pytest.fixture(scope="module")
def png() -> bytes:
    return encode(to_uint8(noisy(smooth_image(48, 40), 25.0)))


def test_a_solve_returns_the_clients_id_and_logs_one_line_with_its_statistics(
    server: Server, png: bytes
) -> None:
    r = httpx.post(
        server.url + "/denoise",
        files={"image": ("a.png", png, "image/png")},
        headers={"X-API-Key": KEY, "X-Request-ID": "client-chosen-42"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-chosen-42"
    line = _access(server, "client-chosen-42")
    assert line["level"] == "info" and line["method"] == "POST" and line["route"] == "/denoise"
    assert line["status"] == 200 and line["error"] is None
    assert line["model"] == r.headers["x-kdeq-model"] == "denoise-kglm:2"
    assert line["iterations"] == int(r.headers["x-kdeq-iterations"]) >= 1
    assert line["residual"] == pytest.approx(float(r.headers["x-kdeq-residual"]))
    assert line["converged"] is (r.headers["x-kdeq-converged"] == "true")
    assert line["batch_size"] == int(r.headers["x-kdeq-batch-size"]) == 1
    assert line["bytes_out"] == len(r.content) and line["bytes_in"] > len(png)
    for phase in ("decode", "queue", "inference", "encode", "total"):
        assert line[f"{phase}_ms"] >= 0
    assert line["ms"] >= line["inference_ms"]


@pytest.mark.parametrize(
    "name, send, status, error",
    [
        ("no key", dict(headers={}), 401, "unauthorized"),
        (
            "bad image",
            dict(files={"image": ("a.png", b"not an image", "image/png")}),
            415,
            "unsupported_media_type",
        ),
        ("bad sigma", dict(data={"sigma": "-3"}), 422, "unprocessable"),
        (
            "too large",
            dict(files={"image": ("a.png", b"\0" * MAX_UPLOAD, "image/png")}),
            413,
            "payload_too_large",
        ),
        ("unknown model", dict(data={"model": "nope"}), 404, "no_model"),
    ],
)
def test_every_refusal_carries_a_fresh_id_in_header_body_and_log(
    server: Server, png: bytes, name: str, send: dict, status: int, error: str | None
) -> None:
    kwargs = {"files": {"image": ("a.png", png, "image/png")}, "headers": {"X-API-Key": KEY}, **send}
    kwargs["headers"] = {**kwargs["headers"], "X-Request-ID": "has a space"}  # invalid: replaced
    r = httpx.post(server.url + "/denoise", timeout=60, **kwargs)
    body = assert_error(r, status, error)
    assert HEX32.fullmatch(body["request_id"]), name
    line = _access(server, body["request_id"])
    assert line["status"] == status and line["error"] == body["error"], (name, line)


def test_probes_answer_with_an_id_and_log_below_info(server: Server) -> None:
    r = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "probe-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "probe-1"
    r = httpx.get(server.url + "/nope")
    assert_error(r, 404)
    _access(server, r.headers["x-request-id"])  # an unknown path is logged
    assert not [e for e in _lines(server) if e["request_id"] == "probe-1"]  # a probe is not, at info


def test_the_key_and_the_images_never_reach_the_log(server: Server, png: bytes) -> None:
    """Run after the tests above (module order): every request they sent, with the key in two header
    forms and images inline or as files, has been logged — and nothing of either is in the log."""
    r = httpx.post(
        server.url + "/denoise",
        files={"image": ("secret-name.png", png, "image/png")},
        headers={"Authorization": f"Bearer {KEY}", "Accept": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200
    _access(server, r.headers["x-request-id"])
    text = server.log.read_text()
    assert KEY not in text
    result = base64.b64decode(r.json()["image"])
    for blob in (png, result):
        for piece in (base64.b64encode(blob[:48]).decode(), blob[8:40].hex(), blob[8:40].decode("latin-1")):
            assert piece not in text
    assert "secret-name.png" not in text
    assert all(isinstance(e, dict) for e in _lines(server))  # every line is one JSON object


def test_the_log_format_setting_rejects_unknown_values(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from service.settings import Settings

    with pytest.raises(ValidationError, match="log_format"):
        Settings(log_format="xml")
