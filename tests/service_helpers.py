"""Images made by the tests, and a real ``python -m service`` process on loopback."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def missing_tool(reason: str) -> None:
    """Skip for lack of an external tool, except under CI (``CI`` set, as ``.ci/run`` does), where
    the tool is installed on purpose and its absence must fail the run rather than hide a check."""
    if os.environ.get("CI"):
        pytest.fail(f"CI needs it: {reason}")
    pytest.skip(reason)


def smooth_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A piecewise-smooth grey image ``(height, width)`` in [0, 1]: a ramp, a disc and a square."""
    rng = np.random.default_rng(seed)
    ii, jj = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    ci, cj = rng.uniform(0.3, 0.7, 2)
    img = 0.25 + 0.4 * jj + 0.1 * np.sin(5 * ii)
    img = np.where((ii - ci) ** 2 + (jj - cj) ** 2 < 0.04, 0.85, img)
    img = np.where((np.abs(ii - 0.2) < 0.1) & (np.abs(jj - 0.75) < 0.1), 0.1, img)
    return np.clip(img, 0, 1)


def noisy(clean: np.ndarray, sigma: float, seed: int = 1) -> np.ndarray:
    """``clean`` plus Gaussian noise of ``sigma`` on the 0–255 scale, clipped to [0, 1]."""
    rng = np.random.default_rng(seed)
    return np.clip(clean + sigma / 255.0 * rng.standard_normal(clean.shape), 0, 1)


def to_uint8(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)


def assert_error(response, status: int, error: str | None = None) -> dict:
    """The JSON error body of ``response``, checked: ``status``, ``{"error", "detail", "request_id"}``
    with a detail and the ID of the ``X-Request-ID`` header, and the ``error`` code when given."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error", "detail", "request_id"} and body["detail"], body
    assert body["request_id"] == response.headers["x-request-id"], (body, response.headers)
    if error is not None:
        assert body["error"] == error, body
    return body


def encode(image: Image.Image | np.ndarray, fmt: str = "PNG", **params: object) -> bytes:
    """An image (PIL, or a float array in [0, 1] or uint8) as file bytes in ``fmt``."""
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image if image.dtype != np.float64 else to_uint8(image))
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def decode(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def psnr(x: np.ndarray, ref: np.ndarray) -> float:
    return float(10 * np.log10(1.0 / np.mean((x - ref) ** 2)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running ``python -m service`` process and its base URL; ``log`` is its combined output."""

    process: subprocess.Popen
    url: str
    log: Path


@contextlib.contextmanager
def run_server(tmp: Path, command: tuple[str, ...] = ("service",), **settings: object) -> Iterator[Server]:
    """Start ``python -m <command>`` with ``KDEQ_<NAME>=value`` for each setting (CPU, defaults from
    ``models/``), wait until ``/readyz`` is 200; kill it afterwards if it is still running."""
    port = free_port()
    # the suite's network precision (tests/conftest.py) stands, so that a server's output can be
    # compared with the same model's in the test's own process
    keep = {"KDEQ_NETWORK_PRECISION"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDEQ_") or k in keep}
    env.update({"KDEQ_PORT": str(port), "KDEQ_DEVICE": "cpu", "KDEQ_MODELS_DIR": str(MODELS)})
    env.update({"KDEQ_LOG_LEVEL": "warning", "KDEQ_DRAIN_SECONDS": "0"})
    env.update({f"KDEQ_{k.upper()}": str(v) for k, v in settings.items()})
    log = tmp / f"server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, env=env, stdout=out, stderr=out)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(server)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_ready(server: Server, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited {server.process.returncode}: {server.log.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.url + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"server not ready in {timeout} s: {server.log.read_text()}")


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name{labels}`` in a Prometheus text exposition (0 when absent)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and an IHDR chunk claiming ``width × height`` grey pixels, then one IDAT of 64
    zero bytes and IEND: a few hundred bytes, whose pixels cannot be decoded (the data is short). A
    refusal for its pixel count therefore shows that the header was checked before any decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )
