"""``GET /ui`` and its files: the trajectory viewer's page (no data in it, so no credentials).

A browser cannot put a bearer token on a page it navigates to, and a cookie would let any
other site's page make the admin's browser call the API. So the page holds nothing: it asks
for the admin key (or takes it from the address's ``#key=`` fragment, which never reaches a
server or its logs, and then clears it), keeps it for the tab only (``sessionStorage``) and
sends it as ``Authorization: Bearer`` to the admin read API (``handlers/viewer.py``). The
Content-Security-Policy lets the page load and call nothing but this proxy.
"""

from __future__ import annotations

from aiohttp import web

from rollout_proxy.errors import NotFound
from rollout_proxy.proxy import keys

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": CSP,
    "Referrer-Policy": "no-referrer",
}
PAGE = "index.html"


def _serve(request: web.Request, name: str) -> web.Response:
    asset = request.app[keys.UI_ASSETS].get(name)
    if asset is None:
        raise NotFound(f"the viewer has no file {name!r}", param="name")
    return web.Response(body=asset.body, content_type=asset.content_type, charset="utf-8", headers=HEADERS)


async def page(request: web.Request) -> web.Response:
    return _serve(request, PAGE)


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == PAGE:
        raise NotFound(f"the viewer has no file {name!r} (the page is /ui)", param="name")
    return _serve(request, name)
