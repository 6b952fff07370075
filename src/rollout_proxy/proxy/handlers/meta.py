"""Operations routes: liveness, readiness, metrics, and the model list for plugins."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when the store answers and at least one engine is healthy."""
    app = request.app
    store_ok = await app[keys.STORE].ping()
    engines = app[keys.ENGINES].engines
    health = await asyncio.gather(*(engine.healthy() for engine in engines))
    ready = store_ok and any(health)
    body = {
        "ready": ready,
        "store": store_ok,
        "engines": {engine.url: ok for engine, ok in zip(engines, health, strict=True)},
    }
    return json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[keys.METRICS].render(), content_type="text/plain")


async def counters(request: web.Request) -> web.Response:
    """``GET /v1/admin/counters``: the proxy's counters as JSON (admin key), for runners and dashboards."""
    request_caller(request, admin_only=True)
    return json_response(request.app[keys.METRICS].counters())


async def models(request: web.Request) -> web.Response:
    request_caller(request)
    data: list[dict[str, Any]] = []
    for engine in request.app[keys.ENGINES].engines:
        info = await engine.info()
        if all(entry["id"] != info.model for entry in data):
            data.append(
                {"id": info.model, "object": "model", "owned_by": "rollout-proxy", "max_model_len": info.max_model_len}
            )
    return json_response({"object": "list", "data": data})
