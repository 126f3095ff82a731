"""kdeq's HTTP service: FastAPI + uvicorn in front of the ``kdeq`` task models."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kdeq")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
