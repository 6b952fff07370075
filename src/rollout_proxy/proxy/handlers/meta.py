"""Operations routes: liveness, readiness, metrics, and the model list for plugins."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from rollout_proxy.errors import AuthenticationFailed, SessionNotFound
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import presents_admin_key
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response

#: Seconds any one readiness check may take: /readyz answers within a second whatever the engines do.
READY_DEADLINE = 0.8


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when the store answers and at least one engine is healthy; answered within a second.

    Every check runs at once, each bounded (a hung engine or store counts as down). Without
    the admin key it says only counts: the engines' URLs are the operator's, not the world's.
    """
    app = request.app
    engines = app[keys.ENGINES].engines
    store_ok, *health = await asyncio.gather(
        _within_deadline(app[keys.STORE].ping()), *(_within_deadline(engine.healthy()) for engine in engines)
    )
    ready = store_ok and any(health)
    summary: dict[str, Any] = {"healthy": sum(health), "total": len(engines)}
    if presents_admin_key(request, app[keys.SETTINGS].admin_key):
        summary["urls"] = {engine.url: ok for engine, ok in zip(engines, health, strict=True)}
    body = {"ready": ready, "store": store_ok, "engines": summary}
    return json_response(body, status=200 if ready else 503)


async def _within_deadline(check: Awaitable[bool]) -> bool:
    try:
        async with asyncio.timeout(READY_DEADLINE):
            return await check
    except TimeoutError:
        return False


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[keys.METRICS].render(), content_type="text/plain")


async def counters(request: web.Request) -> web.Response:
    """``GET /v1/admin/counters``: the proxy's counters as JSON (admin key), for runners and dashboards."""
    request_caller(request, admin_only=True)
    return json_response(request.app[keys.METRICS].counters())


async def models(request: web.Request) -> web.Response:
    """The model list, for the admin key or the token of a session that still exists (401 otherwise)."""
    caller = request_caller(request)
    if caller.session_id is not None:
        try:
            await request.app[keys.SESSIONS].get(caller.session_id)
        except SessionNotFound:
            raise AuthenticationFailed("this session token's session has expired or never existed") from None
    data: list[dict[str, Any]] = []
    for engine in request.app[keys.ENGINES].engines:
        info = await engine.info()
        if all(entry["id"] != info.model for entry in data):
            data.append(
                {"id": info.model, "object": "model", "owned_by": "rollout-proxy", "max_model_len": info.max_model_len}
            )
    return json_response({"object": "list", "data": data})
