"""What every handler needs first: who is calling, and for plugins, their session."""

from __future__ import annotations

import structlog
from aiohttp import web

from rollout_proxy.errors import AuthenticationFailed, InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import Caller, authenticate
from rollout_proxy.proxy.http import read_json_object
from rollout_proxy.proxy.schemas import refuse_pinned
from rollout_proxy.proxy.validation import M, validate
from rollout_proxy.records import SessionRecord


def request_caller(request: web.Request, *, admin_only: bool = False) -> Caller:
    app = request.app
    found = authenticate(
        request, admin_key=app[keys.SETTINGS].admin_key, tokens=app[keys.TOKENS], admin_only=admin_only
    )
    if found.session_id is not None:
        structlog.contextvars.bind_contextvars(session_id=found.session_id)
    return found


async def plugin_session(request: web.Request) -> SessionRecord:
    """The open session named by the caller's token (plugin routes need one)."""
    found = request_caller(request)
    if found.session_id is None:
        raise AuthenticationFailed("this endpoint needs a session token, not the admin key")
    return await request.app[keys.SESSIONS].get_open(found.session_id)


async def plugin_request(request: web.Request, model: type[M]) -> tuple[SessionRecord, M]:
    """A plugin's generation request: its open session, and the body without pinned settings."""
    session = await plugin_session(request)
    payload = await read_json_object(request)
    refuse_pinned(payload)
    body = validate(model, payload)
    if getattr(body, "stream", False):
        raise InvalidRequest("stream=true is not supported yet; call without streaming", param="stream")
    return session, body
