"""What every handler needs first: who is calling. A generation request itself is taken in by
``proxy.intake``."""

from __future__ import annotations

import structlog
from aiohttp import web

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import Caller, authenticate


def request_caller(request: web.Request, *, admin_only: bool = False) -> Caller:
    app = request.app
    found = authenticate(
        request, admin_key=app[keys.SETTINGS].admin_key, tokens=app[keys.TOKENS], admin_only=admin_only
    )
    if found.session_id is not None:
        structlog.contextvars.bind_contextvars(session_id=found.session_id)
    return found
