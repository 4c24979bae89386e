"""The web page for the people watching jobs: plain files from `api/ui`, served under /ui with
a Content-Security-Policy that lets the page load only this origin's own scripts, styles and
images and talk only to this API. Ledger data reaches the page only through the /v1 routes,
with the key the page was given."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

UI_DIR = Path(__file__).resolve().parents[1] / "ui"

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated (ETag), so a new version shows at once
}


class PageFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


def install(app: FastAPI) -> None:
    app.mount("/ui", PageFiles(directory=UI_DIR, html=True), name="ui")

    @app.get("/", include_in_schema=False)
    async def home() -> RedirectResponse:
        # relative, so that it also leads to the page under a proxy's path prefix
        return RedirectResponse("ui/")
