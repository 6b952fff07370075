"""Bounds on a request body, checked before anything is stored or sent to an engine.

Why these numbers:

- ``MAX_DEPTH`` (64): JSON encoders refuse past ~255 levels and a stored session wraps
  the request's values a few levels deeper; no OpenAI shape nests past ~10, so 64 leaves
  free-form objects (``extra``, ``context``, tool ``parameters``, ``arguments``) ~55
  levels of their own. The normalizers apply the same bound inside tool arguments sent
  as a JSON string.
- ``MAX_STRING_CHARS`` (8 Mi characters): one string may fill the largest context an
  engine serves (1M tokens is ~4M characters), or hold an image as a base64 data URL (8 Mi
  characters are ~6 MiB of image: ``--max-image-bytes`` is 5 MiB by default); past that it can
  only be refused later, after costing a tokenization. Context length itself is checked on every path.
- ``MAX_NAME_CHARS`` (256): names and ids (function names, call ids, response ids);
  OpenAI's own limits are lower (64 for function names).
- ``MAX_MESSAGES`` (10,000): a long agent run resends its whole history each turn;
  thousands of tool rounds fit, an unbounded list does not.
- ``MAX_TOOLS`` / ``MAX_TOOL_CALLS`` (1,024) and ``MAX_CONTENT_PARTS`` (10,000).
- The body as a whole is bounded in bytes by the server (``max_body_bytes``, 413).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import orjson

from rollout_proxy.errors import InvalidRequest
from rollout_proxy.wire.messages import MAX_JSON_DEPTH

MAX_DEPTH = MAX_JSON_DEPTH
MAX_STRING_CHARS = 8 * 1024 * 1024
MAX_NAME_CHARS = 256
MAX_MESSAGES = 10_000
MAX_TOOLS = 1024
MAX_TOOL_CALLS = 1024
MAX_CONTENT_PARTS = 10_000

Loc = Sequence[str | int]


def format_param(loc: Loc) -> str | None:
    """A location as OpenAI names it: ``messages[2].tool_calls[0].function.arguments``."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param or None


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object within the bounds above (400 naming the place otherwise)."""
    payload = load_json_object(body)
    check_json_limits(payload)
    return payload


def load_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, its bounds not checked yet (``check_json_limits``)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return payload


def check_json_limits(
    payload: Any,
    *,
    messages_to_check: Sequence[int] | None = None,
    key: str = "messages",
    checked: Collection[str] = (),
) -> None:
    """Depth and string lengths (object keys too) over the whole value; of the list under ``key``
    (``messages``; a Responses body's ``input``), only the items at ``messages_to_check`` when given (the
    others were checked whole before, at this same depth); ``checked``: top-level keys whose values were
    checked before (the same JSON at the same depth: the request's tools), left out. 400 naming where."""
    try:
        if checked and type(payload) is dict:
            payload = {name: value for name, value in payload.items() if name not in checked}
        messages = payload.get(key) if messages_to_check is not None and type(payload) is dict else None
        if type(messages) is not list or messages_to_check is None:
            _walk(payload, 1)
            return
        _walk({name: value for name, value in payload.items() if name != key}, 1)
        try:
            for index in messages_to_check:
                _check(index, messages[index], 2)
        except _Refused as refused:
            refused.loc.append(key)
            raise
    except _Refused as refused:
        raise InvalidRequest(refused.message, param=format_param(refused.loc[::-1])) from None


class _Refused(Exception):
    """Raised where a bound is crossed; each level adds its key on the way out."""

    def __init__(self, message: str, loc: list[str | int] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.loc = loc or []


_SCALARS = frozenset({int, float, bool, type(None)})


def _walk(value: Any, depth: int) -> None:
    # Recursion is safe: it stops at MAX_DEPTH, far below Python's limit.
    if depth > MAX_DEPTH:
        raise _Refused(f"JSON nested deeper than {MAX_DEPTH} levels")
    if type(value) is dict:
        items: Any = value.items()
    elif _SCALARS.issuperset(map(type, value)):  # numbers only: nothing to look into
        return
    else:
        items = enumerate(value)
    for key, item in items:
        _check(key, item, depth)


def _check(key: str | int, item: Any, depth: int) -> None:
    """One entry of a container at ``depth``."""
    kind = type(item)
    if kind is str:
        if len(item) > MAX_STRING_CHARS:
            raise _Refused(f"a string longer than {MAX_STRING_CHARS} characters", [key])
    elif kind is dict or kind is list:
        try:
            _walk(item, depth + 1)
        except _Refused as refused:
            refused.loc.append(key)
            raise
    if type(key) is str and len(key) > MAX_STRING_CHARS:
        raise _Refused(f"an object key longer than {MAX_STRING_CHARS} characters")
