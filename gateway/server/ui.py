"""The operators' page at /ui: static HTML, JS and CSS shipped in the package, reading the admin API.

The page itself is public and holds no data: it asks for the admin token, keeps it in the tab's
sessionStorage and sends it as a bearer header to /admin/*, which checks it like any other caller.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from gateway.errors import NotFound

ASSETS = {"ui.html": "text/html", "ui.js": "text/javascript", "ui.css": "text/css"}
# The page loads only its own files and talks only to this gateway.
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def add_routes(router: web.UrlDispatcher) -> None:
    static = resources.files("gateway.server") / "static"
    assets = {name: static.joinpath(name).read_bytes() for name in ASSETS}

    async def page(request: web.Request) -> web.Response:
        return _asset(assets, "ui.html")

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in assets:
            raise NotFound(f"No file {name!r} in the operators' page", code="unknown_path")
        return _asset(assets, name)

    router.add_get("/ui", page)
    router.add_get("/ui/", page)
    router.add_get("/ui/{name}", asset)


def _asset(assets: dict[str, bytes], name: str) -> web.Response:
    return web.Response(body=assets[name], content_type=ASSETS[name], charset="utf-8", headers=HEADERS)
