"""``GET /v1/feed?after=CURSOR&limit=N``: the trainer feed, paged by cursor (admin key)."""

from __future__ import annotations

from aiohttp import web

from rollout_proxy.errors import InvalidRequest, NotFound
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response

MAX_PAGE = 1000


async def read_feed(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    feed = request.app.get(keys.FEED)
    if feed is None:
        raise NotFound("this proxy serves no trainer feed (start it with --feed jsonl:PATH or --feed redis://...)")
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        raise InvalidRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be between 1 and {MAX_PAGE}", param="limit")
    after = request.query.get("after") or None
    entries = await feed.read(after, limit)
    return json_response(
        {
            "entries": [{"id": entry.id, "data": entry.group.model_dump(mode="json")} for entry in entries],
            "next": entries[-1].id if entries else after,
        }
    )
