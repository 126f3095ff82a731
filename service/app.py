"""The FastAPI application: ``create_app(settings)`` wires the service, its middlewares and routes.

The lifespan starts the background model load (``Service.start``) and, at
shutdown, finishes the queued requests before the workers end.

The PNG codec — decoding an upload and preparing the task's request, encoding the
result — runs on worker threads, never on the event loop, at most one per core
the process has (``kdeq.runtime.threads.available_cores``: its CPU affinity and cgroup
quota) at once: ``app.state.codec``, a capacity limiter on anyio's threads. It is
CPU work that mostly releases the GIL (zlib, Pillow's decoder, numpy), so more
threads than cores would only share them, holding more decoded images in memory
and lengthening every request's codec time alike, while starlette's default
limit (40 threads) admits 32 clients' codecs at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from anyio import CapacityLimiter
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from kdeq.runtime.threads import available_cores
from service import __version__
from service.apidocs import install_api_docs
from service.errors import install_error_handlers
from service.middleware import AccessLog, Admission, ApiKey, BodyLimit, RequestId, RequestMetrics
from service.routes import STATIC, router
from service.settings import Settings
from service.state import Service

DESCRIPTION = """Kernel-GLM deep equilibrium models for images. Every inference request runs a
fixed-point solve whose iterations, relative residual and convergence are returned in the
`X-KDEQ-*` headers and exported at `/metrics`. Errors are JSON `{"error", "detail", "request_id"}`;
every response carries its request's ID in `X-Request-ID` (the client's own, when it sends a valid one)."""


def create_app(settings: Settings) -> FastAPI:
    """The application for ``settings``; its ``Service`` is ``app.state.service``."""
    service = Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await asyncio.to_thread(service.stop)

    app = FastAPI(
        title="kdeq",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served by install_api_docs, from local files
        redoc_url=None,
    )
    app.state.service = service
    app.state.codec = CapacityLimiter(available_cores())
    install_error_handlers(app)
    install_api_docs(app)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # added innermost first: metrics see every response, including the key and size refusals
    app.add_middleware(BodyLimit, max_bytes=settings.max_upload_bytes, metrics=service.metrics)
    app.add_middleware(Admission, admit=service.engine.admit, release=service.engine.release)
    key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    app.add_middleware(ApiKey, key=key)
    app.add_middleware(RequestMetrics, metrics=service.metrics)
    app.add_middleware(AccessLog)
    app.add_middleware(RequestId)  # outermost: every response and log line of the request has its ID
    return app
