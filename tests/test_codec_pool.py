"""The PNG codec's pool (``service.app``): decoding and encoding run on worker threads, never the event
loop's, at most one per core the process has at once."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import httpx2 as httpx
import numpy as np
import pytest

import service.routes
from kdeq.runtime.threads import available_cores
from service.app import create_app
from service.settings import Settings
from tests.service_helpers import MODELS, decode, encode, noisy, smooth_image, to_uint8

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")

SETTINGS = Settings(models_dir=MODELS, device=("cpu",), models=("denoise-kglm",), warmup=False)
REQUESTS = 4
# how long each codec call holds its thread: long enough that the requests' calls would overlap
# were more than one thread allowed (they are sent at once, and a solve of 32² takes milliseconds)
HOLD_SECONDS = 0.05


class CodecCalls:
    """Wraps the routes' ``decode_image`` and ``encode_png``: records the thread of each call and the
    most calls in progress at once, and holds each call ``HOLD_SECONDS`` before doing its work."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.threads: list[tuple[str, int, bool]] = []  # (function, thread ident, loop running there)
        for name in ("decode_image", "encode_png"):
            monkeypatch.setattr(service.routes, name, self._wrap(name, getattr(service.routes, name)))

    def _wrap(self, name: str, work: Callable) -> Callable:
        def wrapper(*args: object, **kwargs: object) -> object:
            with self.lock:
                self.active += 1
                self.peak = max(self.peak, self.active)
                self.threads.append((name, threading.get_ident(), asyncio._get_running_loop() is not None))
            try:
                time.sleep(HOLD_SECONDS)
                return work(*args, **kwargs)
            finally:
                with self.lock:
                    self.active -= 1

        return wrapper


def make_app(cpus: set[int] | None = None):
    """The app, created while this thread's CPU affinity is ``cpus`` (default: unchanged); the
    affinity is restored before anything runs, so that the service's threads do not inherit it."""
    if cpus is None:
        return create_app(SETTINGS)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return create_app(SETTINGS)
    finally:
        os.sched_setaffinity(0, before)


async def serve_requests(app, png: bytes) -> tuple[int, list[httpx.Response]]:
    """The event loop's thread ident, and ``REQUESTS`` concurrent ``/denoise`` answers for ``png``."""
    async with app.router.lifespan_context(app):
        assert await asyncio.to_thread(app.state.service.wait_loaded, 120)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kdeq") as client:
            form = {"sigma": "20", "max_iter": "2"}
            responses = await asyncio.gather(
                *(client.post("/denoise", files={"image": png}, data=form) for _ in range(REQUESTS))
            )
        return threading.get_ident(), list(responses)


def test_the_pool_has_a_token_per_core_the_process_has() -> None:
    assert make_app().state.codec.total_tokens == available_cores()
    assert make_app({min(os.sched_getaffinity(0))}).state.codec.total_tokens == 1


def test_decode_and_encode_run_off_the_event_loop_one_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = CodecCalls(monkeypatch)
    app = make_app({min(os.sched_getaffinity(0))})  # one core: one codec call at a time
    png = encode(to_uint8(noisy(smooth_image(32, 32), 20)))
    loop_thread, responses = asyncio.run(serve_requests(app, png))
    for response in responses:
        assert response.status_code == 200, response.text
        assert np.asarray(decode(response.content)).shape == (32, 32)
    assert (
        sorted(name for name, _, _ in calls.threads)
        == ["decode_image"] * REQUESTS + ["encode_png"] * REQUESTS
    )
    assert all(ident != loop_thread and not on_loop for _, ident, on_loop in calls.threads)
    # the default thread limiter (40) would have run the four requests' decodes together
    assert calls.peak == 1
