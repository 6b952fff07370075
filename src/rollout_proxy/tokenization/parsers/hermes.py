"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Arguments are returned as a JSON string (OpenAI's form). A block that does not
parse stays in the content and the outcome says MALFORMED, so a reward that rises
with zero tool calls can be traced to the parser.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollout_proxy.ids import new_tool_call_id
from rollout_proxy.tokenization.parsers.base import ToolParse
from rollout_proxy.wire.messages import too_deep

_INVALID = object()
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _loads(text: str) -> Any:
    """JSON, or ``_INVALID``: a model can write anything, nesting too deep to store included."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID
    return _INVALID if too_deep(value) else value


def _parse_call(body: str) -> dict[str, Any] | None:
    payload = _loads(body)
    if payload is _INVALID:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _loads(arguments)
        if arguments is _INVALID:
            return None
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": payload["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class HermesToolParser:
    def extract(self, text: str) -> tuple[str, list[dict[str, Any]], ToolParse]:
        if "<tool_call>" not in text:
            return text, [], ToolParse.NO_CALLS
        calls: list[dict[str, Any]] = []
        kept: list[str] = []
        malformed = False
        position = 0
        for match in _BLOCK.finditer(text):
            kept.append(text[position : match.start()])
            position = match.end()
            call = _parse_call(match.group(1).strip())
            if call is None:
                malformed = True
                kept.append(match.group(0))
            else:
                calls.append(call)
        kept.append(text[position:])
        outcome = ToolParse.MALFORMED if malformed else ToolParse.CALLS
        return "".join(kept).strip(), calls, outcome
