"""Trajectory fetch, by response id or by session (admin key or that session's token)."""

from __future__ import annotations

from aiohttp import web

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response


async def response_trajectory(request: web.Request) -> web.Response:
    found = request_caller(request)
    trajectory = await request.app[keys.SESSIONS].trajectory(
        request.match_info["response_id"], session_id=None if found.admin else found.session_id
    )
    return json_response(trajectory.to_json())


async def session_rollout(request: web.Request) -> web.Response:
    """``GET /v1/sessions/{id}/rollout``: every sequence of the session's tree, each sampled token trained once."""
    session_id = request.match_info["session_id"]
    request_caller(request).require_session(session_id)
    return json_response((await request.app[keys.SESSIONS].rollout(session_id)).to_json())


async def session_trajectory(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    request_caller(request).require_session(session_id)
    trajectory = await request.app[keys.SESSIONS].latest_trajectory(session_id)
    return json_response(trajectory.to_json())
