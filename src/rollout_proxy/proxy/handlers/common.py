"""What every handler needs first: who is calling, and for plugins, their session."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import structlog
from aiohttp import web

from rollout_proxy.errors import AuthenticationFailed
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import Caller, authenticate
from rollout_proxy.proxy.http import read_body
from rollout_proxy.proxy.known_messages import MessageIntake
from rollout_proxy.proxy.limits import check_json_limits, load_json_object
from rollout_proxy.proxy.schemas import refuse_pinned
from rollout_proxy.proxy.validation import CHECK_ITEMS, M, validate
from rollout_proxy.records import SessionRecord
from rollout_proxy.state.store import ReadAhead


def request_caller(request: web.Request, *, admin_only: bool = False) -> Caller:
    app = request.app
    found = authenticate(
        request, admin_key=app[keys.SETTINGS].admin_key, tokens=app[keys.TOKENS], admin_only=admin_only
    )
    if found.session_id is not None:
        structlog.contextvars.bind_contextvars(session_id=found.session_id)
    return found


async def plugin_session(request: web.Request, *, read_ahead: ReadAhead | None = None) -> SessionRecord:
    """The open session named by the caller's token (plugin routes need one)."""
    found = request_caller(request)
    if found.session_id is None:
        raise AuthenticationFailed("this endpoint needs a session token, not the admin key")
    return await request.app[keys.SESSIONS].get_open(found.session_id, read_ahead=read_ahead)


async def plugin_request(
    request: web.Request,
    model: type[M],
    *,
    read_ahead: Callable[[M], ReadAhead | None] | None = None,
    intake: MessageIntake | None = None,
) -> tuple[SessionRecord, M]:
    """A plugin's generation request: its open session, and the body without pinned settings.

    With ``read_ahead``, the body is checked first and the session read with what the turn reads next
    and, when the token names the session's request bound, the bound's slot taken (one store round trip
    for all: ``state.store.ReadAhead``). With ``intake``, the body's messages already known to the app
    are not checked again (``proxy.known_messages``)."""
    if read_ahead is None:
        session = await plugin_session(request)
        return session, await _plugin_body(request, model, intake, session.id, session.expires_at)
    found = request_caller(request)
    if found.session_id is None:
        raise AuthenticationFailed("this endpoint needs a session token, not the admin key")
    body = await _plugin_body(request, model, intake, found.session_id, found.expires_at)
    ahead = read_ahead(body)
    if found.bound is not None:
        ahead = dataclasses.replace(ahead or ReadAhead(), bound=found.bound)
    return await request.app[keys.SESSIONS].get_open(found.session_id, read_ahead=ahead), body


async def _plugin_body(
    request: web.Request,
    model: type[M],
    intake: MessageIntake | None = None,
    session_id: str | None = None,
    expires_at: float = 0.0,
) -> M:
    """The request's body as ``model``, without the settings the session pins; with ``intake``, the messages
    it knows are not checked again (the limits walk and the shape check skip them) and what it learns is kept
    until the session's expiry at most."""
    body = await read_body(request)
    payload = load_json_object(body) if intake is None else intake.load(body, session_id=session_id)
    to_check = (
        None
        if intake is None
        else intake.look_up(payload.get("messages"), session_id=session_id, expires_at=expires_at)
    )
    check_json_limits(payload, messages_to_check=to_check)
    refuse_pinned(payload)
    return validate(model, payload, context=None if to_check is None else {CHECK_ITEMS: to_check})
