"""The API's documentation page, served with every file it needs: nothing from a CDN, so ``/docs``
(Swagger UI) renders on an air-gapped host.

The Swagger UI bundle is a file of the pinned ``fastapi-offline`` package (its code is not used),
mounted at ``ASSETS_URL``; the page is FastAPI's own, pointed at it. ReDoc is left out: its bundle
fetches its maker's logo from the network. ``/favicon.ico`` is the service's icon (also the docs
page's and the web page's).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"
ASSETS = Path(str(files("fastapi_offline") / "static"))
FAVICON = Path(__file__).parent / "static" / "favicon.ico"
TITLE = "kdeq API"


def install_api_docs(app: FastAPI) -> None:
    """``GET /docs`` and ``/favicon.ico`` on ``app``, whose own docs pages must be off
    (``docs_url=None, redoc_url=None``), with the bundle mounted at ``ASSETS_URL``."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=TITLE,
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url="/favicon.ico",
        )

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        return FileResponse(FAVICON, media_type="image/vnd.microsoft.icon")
