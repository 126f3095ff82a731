"""One uvicorn process serving the configured devices, with a graceful drain.

On SIGTERM ``/readyz`` turns 503 at once while requests are still served for
``KDEQ_DRAIN_SECONDS`` (so a load balancer stops sending new ones); then the
listener closes, requests in flight complete (up to the request timeout), the
queue empties and the process exits 0. SIGINT, or a second SIGTERM during the
drain, skips the rest of the drain: uvicorn's own graceful shutdown starts at
once and the process ends by that signal (a SIGINT during that shutdown stops
without waiting for requests).

When a device fails (a sticky CUDA error; ``Service.fault``) the server shuts
down at once — the engine has already answered the queued requests with 503,
the requests in flight get their answers — and ``serve`` returns
``EXIT_DEVICE_FAILED``, so that the orchestrator restarts the process.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from service import logs, tracing
from service.app import create_app
from service.settings import Settings
from service.state import Service

log = logging.getLogger("kdeq.service")

# the exit status after a device failure: non-zero so that a restart policy (`on-failure`) restarts it
EXIT_DEVICE_FAILED = 3


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain described in the module docstring."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self.drain_started: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_started is None:
            self.drain_started = time.monotonic()
            self.service.begin_drain()
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.service.fault is not None:  # no drain: nothing more can be served here
            return True
        drain = self.service.settings.drain_seconds
        if self.drain_started is not None and time.monotonic() - self.drain_started >= drain:
            return True
        return await super().on_tick(counter)


def serve(settings: Settings) -> int:
    """Run the server in this process until it is stopped; the exit status: 0, or
    ``EXIT_DEVICE_FAILED`` when it stopped because a device failed."""
    logs.configure(settings.log_level, settings.log_format)
    tracing.configure()
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # uvicorn's records go to the root handler (one format); its access line is ours (AccessLog)
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.request_timeout_seconds) + 5,
    )
    service = app.state.service
    DrainingServer(config, service).run()
    if service.fault is not None:
        log.critical("exiting with status %d: device %s", EXIT_DEVICE_FAILED, service.fault)
        return EXIT_DEVICE_FAILED
    return 0
