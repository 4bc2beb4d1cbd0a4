"""GET / and the page's files: fixed names mapped to files of this package (a request names
no file), sent as they are; and /playground/config.json, what the page needs to know first."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

from nanoserve.server.config import ServerConfig
from nanoserve.server.errors import APIError

PAGE_DIR = Path(__file__).parent
PAGE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "timeline.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
NO_CACHE = {"Cache-Control": "no-cache"}  # a new version of the server serves its new page


def router(config: ServerConfig) -> APIRouter:
    """/, /playground/{file} and /playground/config.json."""
    api = APIRouter()

    @api.get("/", include_in_schema=False)
    async def index() -> Response:
        return _page_file("index.html")

    @api.get("/playground/config.json", include_in_schema=False)
    async def page_config() -> JSONResponse:
        return JSONResponse(
            {
                "model": config.served_model_names[0],
                "api_key_required": config.api_key is not None,
                "peers": [name for name, _ in config.playground_peers],
            },
            headers=NO_CACHE,
        )

    @api.get("/playground/{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        if name not in PAGE_FILES:
            raise APIError(f"the playground has no file {name!r}", 404)
        return _page_file(name)

    return api


def _page_file(name: str) -> Response:
    return FileResponse(PAGE_DIR / name, media_type=PAGE_FILES[name], headers=NO_CACHE)
