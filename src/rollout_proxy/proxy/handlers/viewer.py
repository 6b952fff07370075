"""The admin read API behind the viewer (admin key): sessions, a session's tree, a trajectory's tokens.

Query parameters are checked strictly (an unknown, repeated or malformed one is a 400 naming
it): a filter that silently did nothing would show the wrong sessions.
"""

from __future__ import annotations

import math
import re

from aiohttp import web

from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response
from rollout_proxy.ui.service import SessionFilter

MAX_PAGE = 200
DEFAULT_PAGE = 50
MAX_TEXT = 256
_INTEGER = re.compile(r"^[0-9]{1,6}$")
_NUMBER = re.compile(r"^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$")
_BOOLEANS = {"true": True, "false": False}
STATUSES = ("open", "finished")
TEXT_PARAMS = ("cursor", "job", "finish_reason", "policy_version", "policy")
FLAG_PARAMS = ("forks", "drift", "graded")
NUMBER_PARAMS = ("min_reward", "max_reward")
LIST_PARAMS = frozenset({"limit", "status", *TEXT_PARAMS, *FLAG_PARAMS, *NUMBER_PARAMS})


def _query(request: web.Request) -> dict[str, str]:
    values: dict[str, str] = {}
    for name in request.query:
        if name not in LIST_PARAMS:
            raise InvalidRequest(f"unknown query parameter {name!r}", param=name)
        given = request.query.getall(name)
        if len(given) > 1:
            raise InvalidRequest(f"query parameter {name!r} is given {len(given)} times", param=name)
        values[name] = given[0]
    return values


def _text(query: dict[str, str], name: str) -> str | None:
    value = query.get(name)
    if value is not None and not 1 <= len(value) <= MAX_TEXT:
        raise InvalidRequest(f"{name} must be 1 to {MAX_TEXT} characters", param=name)
    return value


def _flag(query: dict[str, str], name: str) -> bool | None:
    value = query.get(name)
    if value is not None and value not in _BOOLEANS:
        raise InvalidRequest(f"{name} must be true or false", param=name)
    return None if value is None else _BOOLEANS[value]


def _number(query: dict[str, str], name: str) -> float | None:
    value = query.get(name)
    if value is None:
        return None
    number = float(value) if _NUMBER.match(value) else math.nan
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a finite number", param=name)
    return number


def parse_list_query(request: web.Request) -> tuple[SessionFilter, str | None, int]:
    query = _query(request)
    raw_limit = query.get("limit", str(DEFAULT_PAGE))
    limit = int(raw_limit) if _INTEGER.match(raw_limit) else 0
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_PAGE}", param="limit")
    status = query.get("status")
    if status is not None and status not in STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(STATUSES)}", param="status")
    where = SessionFilter(
        status=status,
        job_id=_text(query, "job"),
        finish_reason=_text(query, "finish_reason"),
        forks=_flag(query, "forks"),
        drift=_flag(query, "drift"),
        policy_version=_text(query, "policy_version"),
        policy=_text(query, "policy"),
        graded=_flag(query, "graded"),
        min_reward=_number(query, "min_reward"),
        max_reward=_number(query, "max_reward"),
    )
    return where, _text(query, "cursor"), limit


async def list_sessions(request: web.Request) -> web.Response:
    """``GET /v1/admin/sessions``: live sessions, newest first, filtered and paged by cursor."""
    request_caller(request, admin_only=True)
    where, cursor, limit = parse_list_query(request)
    return json_response(await request.app[keys.VIEWER].list_sessions(where, cursor=cursor, limit=limit))


async def session_tree(request: web.Request) -> web.Response:
    """``GET /v1/admin/sessions/{session_id}``: the session, every node of its tree, its grades."""
    request_caller(request, admin_only=True)
    return json_response(await request.app[keys.VIEWER].session(request.match_info["session_id"]))


async def response_tokens(request: web.Request) -> web.Response:
    """``GET /v1/admin/responses/{response_id}/tokens``: a trajectory token by token, for the viewer."""
    request_caller(request, admin_only=True)
    return json_response(await request.app[keys.VIEWER].tokens(request.match_info["response_id"]))
