"""The Responses API wire format: input items to messages, a node to a response object.

Input items: messages (string or content parts), ``function_call_output``, and prior
``function_call`` / ``reasoning`` items echoed back by clients (folded into the
assistant message they came from). Output items: ``reasoning``, ``message`` with
``output_text``, ``function_call``; their ids derive from the node id, so a stored
response reads back identically.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout_proxy.core.types import ResponseNode, SessionRecord
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.tokenization.messages import content_text, normalize_message


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "\n".join(part.get("text", "") for part in parts if isinstance(part, dict))


def input_to_messages(value: Any, *, param: str = "input") -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("input must be a string or a list of items", param=param)
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for index, item in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequest("an input item must be an object", param=where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            message = normalize_message({"role": item.get("role"), "content": item.get("content")}, param=where)
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "reasoning":
            reasoning = _reasoning_text(item) or None
        elif kind == "function_call":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise InvalidRequest("a function_call item needs call_id and name", param=where)
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(normalize_message(message, param=where))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest("a function_call_output item needs call_id", param=where)
            output = content_text(item.get("output"), param=where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output or ""})
        else:
            raise InvalidRequest(f"unsupported input item type {kind!r}", param=f"{where}.type")
    return messages


def output_items(node: ResponseNode) -> list[dict[str, Any]]:
    message = node.messages[-1]
    suffix = node.id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{suffix}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
                "status": "completed",
            }
        )
    if message.get("content"):
        items.append(
            {
                "type": "message",
                "id": f"msg_{suffix}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}],
            }
        )
    for index, call in enumerate(message.get("tool_calls") or []):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{suffix}_{index}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def flat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [{"type": "function", "strict": None, **tool["function"]} for tool in tools or []]


def response_body(
    node: ResponseNode,
    *,
    prompt_ids: np.ndarray,
    session: SessionRecord,
    tools: list[dict[str, Any]] | None,
    model: str | None = None,
) -> dict[str, Any]:
    usage = node.usage
    incomplete = node.finish_reason == "length"
    generation = session.generation
    return {
        "id": node.id,
        "object": "response",
        "created_at": int(node.created_at),
        "model": model or node.model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "instructions": node.meta.get("instructions"),
        "previous_response_id": node.meta.get("previous_response_id"),
        "output": output_items(node),
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": flat_tools(tools),
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "max_output_tokens": generation.max_new_tokens,
        "store": node.meta.get("store", True),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "finish_reason": node.finish_reason,
        "prompt_token_ids": prompt_ids,
        "token_ids": node.output_ids,
    }
