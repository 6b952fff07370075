"""``GET /v1/feed?after=CURSOR&limit=N``: the trainer feed, paged by cursor (admin key)."""

from __future__ import annotations

from aiohttp import web

from rollout_proxy import keys
from rollout_proxy.errors import InvalidRequest, NotFound
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
    try:
        entries = await feed.read(after, limit)
    except ValueError:
        raise InvalidRequest(f"{after!r} is not a cursor of this feed", param="after") from None
    return json_response(
        {
            "entries": [{"id": entry_id, "data": data} for entry_id, data in entries],
            "next": entries[-1][0] if entries else after,
        }
    )
