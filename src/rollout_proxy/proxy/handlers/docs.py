"""``GET /openapi.json``: the proxy's own API, described (no credentials: it exposes no data)."""

from __future__ import annotations

from aiohttp import web

from rollout_proxy.proxy.openapi import document_bytes


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=document_bytes(), content_type="application/json")
