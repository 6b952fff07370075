"""Operations routes: liveness, readiness, metrics, and the model list for plugins."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from rollout_proxy.engines.health import EngineState
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
    """Ready when the store answers and an engine is healthy (or paused for a weight update: turns
    queue and are answered after the resume); answered within a second.

    Engine health is the fleet's, kept by its background probes: nothing here waits on an engine.
    The store's ping is bounded. Without the admin key it says only counts: the engines' URLs are
    the operator's, not the world's.
    """
    app = request.app
    fleet = app[keys.ENGINES]
    store_ok = await _within_deadline(app[keys.STORE].ping())
    ready = store_ok and fleet.ready()
    summary: dict[str, Any] = {"healthy": fleet.count(EngineState.HEALTHY), "total": len(fleet.members)}
    if presents_admin_key(request, app[keys.SETTINGS].admin_key):
        summary["urls"] = {url: member.routable for url, member in fleet.members.items()}
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
    infos = await request.app[keys.ENGINES].models()
    if not infos:
        raise request.app[keys.ENGINES].unavailable()
    for info in infos:
        if all(entry["id"] != info.model for entry in data):
            data.append(
                {"id": info.model, "object": "model", "owned_by": "rollout-proxy", "max_model_len": info.max_model_len}
            )
    return json_response({"object": "list", "data": data})
