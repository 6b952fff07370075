"""Identifiers.

A response id embeds its session id (``resp_<session hex><node hex>``) so that a
trajectory can be found from the id alone, in one store read, and so that an id of
another session is recognised without any global index.
"""

from __future__ import annotations

import re
import secrets

_HEX = 16
SESSION_PREFIX = "sess_"
RESPONSE_PREFIX = "resp_"
_SESSION_RE = re.compile(rf"^{SESSION_PREFIX}([0-9a-f]{{{_HEX}}})$")
_RESPONSE_RE = re.compile(rf"^{RESPONSE_PREFIX}([0-9a-f]{{{_HEX}}})([0-9a-f]{{{_HEX}}})$")


def new_session_id() -> str:
    return SESSION_PREFIX + secrets.token_hex(_HEX // 2)


def new_response_id(session_id: str) -> str:
    match = _SESSION_RE.match(session_id)
    if match is None:
        raise ValueError(f"not a session id: {session_id!r}")
    return RESPONSE_PREFIX + match.group(1) + secrets.token_hex(_HEX // 2)


def session_of_response(response_id: str) -> str | None:
    """The session a response id belongs to, or None when it is not a response id."""
    match = _RESPONSE_RE.match(response_id)
    return None if match is None else SESSION_PREFIX + match.group(1)


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(8)
