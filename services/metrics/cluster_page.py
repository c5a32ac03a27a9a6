"""The live cluster page: static HTML, one vanilla JS file and a stylesheet, packaged with
the collector (`services/metrics/page/`), no CDN and no build step.

`page_router()` serves them under `PAGE_PATH`; the page polls the collector's `/cluster`
JSON every second and renders it (every string from the network goes into the DOM as
text, never as markup). `http_api.build_app` includes the router.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, HTTPException, Response
from fastapi.responses import RedirectResponse

PAGE_PATH = "/cluster/page"
_ASSETS = {  # file name -> media type; nothing else under page/ is served
    "index.html": "text/html; charset=utf-8",
    "cluster.js": "text/javascript; charset=utf-8",
    "cluster.css": "text/css; charset=utf-8",
}


def load_assets() -> dict[str, bytes]:
    folder = resources.files("services.metrics").joinpath("page")
    return {name: folder.joinpath(name).read_bytes() for name in _ASSETS}


def page_router() -> APIRouter:
    assets = load_assets()  # read once: a missing asset fails at start, not on the first visit
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(PAGE_PATH)

    @router.get(PAGE_PATH, include_in_schema=False)
    def page() -> Response:
        return Response(assets["index.html"], media_type=_ASSETS["index.html"],
                        headers={"Cache-Control": "no-cache"})

    @router.get(PAGE_PATH + "/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in assets:
            raise HTTPException(status_code=404)
        return Response(assets[name], media_type=_ASSETS[name], headers={"Cache-Control": "no-cache"})

    return router
