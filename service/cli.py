"""The command line of the service: ``kdeq serve`` (a ``kdeq.commands`` entry point) and
``python -m service``. Light to import: the server stack loads only when it runs."""

from __future__ import annotations

import argparse
import os
import sys

from service.settings import Settings, SettingsError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="overrides KDEQ_HOST")
    parser.add_argument("--port", type=int, help="overrides KDEQ_PORT")
    parser.add_argument("--device", help="overrides KDEQ_DEVICE")
    parser.add_argument("--models-dir", help="overrides KDEQ_MODELS_DIR")


def run(args: argparse.Namespace) -> int:
    """Serve with settings from the environment, overridden by ``args``; the exit status: 2 on
    invalid settings (a CUDA device that is not usable included, with the reason), 3 after a device
    failed while serving, else 0."""
    try:
        settings = Settings.from_env(
            os.environ, host=args.host, port=args.port, device=args.device, models_dir=args.models_dir
        )
    except SettingsError as err:
        print(f"kdeq serve: {err}", file=sys.stderr)
        return 2
    from service.server import serve

    return serve(settings)


def register(subparsers: argparse._SubParsersAction) -> None:
    """The ``kdeq serve`` subcommand (registered through the ``kdeq.commands`` entry point)."""
    parser = subparsers.add_parser("serve", help="run the HTTP service (settings from KDEQ_* variables)")
    add_arguments(parser)
    parser.set_defaults(handler=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service", description="run the kdeq HTTP service")
    add_arguments(parser)
    return run(parser.parse_args(argv))
