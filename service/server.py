"""``kdeq serve`` / ``python -m service``: one uvicorn process serving the configured devices.

Shutdown on SIGTERM is graceful: ``/readyz`` turns 503 at once while requests
are still served for ``KDEQ_DRAIN_SECONDS`` (so a load balancer stops sending
new ones), then the listener closes, requests in flight complete (up to the
request timeout), the queue empties and the process exits 0. A second signal,
or SIGINT, stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from types import FrameType

import uvicorn

from service.app import create_app
from service.settings import Settings, SettingsError
from service.state import Service


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
        drain = self.service.settings.drain_seconds
        if self.drain_started is not None and time.monotonic() - self.drain_started >= drain:
            return True
        return await super().on_tick(counter)


def serve(settings: Settings) -> None:
    """Run the server in this process until it is stopped."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.request_timeout_seconds) + 5,
    )
    DrainingServer(config, app.state.service).run()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="overrides KDEQ_HOST")
    parser.add_argument("--port", type=int, help="overrides KDEQ_PORT")
    parser.add_argument("--device", help="overrides KDEQ_DEVICE")
    parser.add_argument("--models-dir", help="overrides KDEQ_MODELS_DIR")


def run(args: argparse.Namespace) -> int:
    """Serve with settings from the environment, overridden by ``args``; 2 on invalid settings."""
    try:
        settings = Settings.from_env(
            os.environ, host=args.host, port=args.port, device=args.device, models_dir=args.models_dir
        )
    except SettingsError as err:
        print(f"kdeq serve: {err}", file=sys.stderr)
        return 2
    serve(settings)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """The ``kdeq serve`` subcommand (registered through the ``kdeq.commands`` entry point)."""
    parser = subparsers.add_parser("serve", help="run the HTTP service (settings from KDEQ_* variables)")
    add_arguments(parser)
    parser.set_defaults(handler=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description="run the kdeq HTTP service")
    add_arguments(parser)
    return run(parser.parse_args(argv))
