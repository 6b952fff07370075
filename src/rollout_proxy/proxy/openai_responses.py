"""A response node as a Responses API object (the input side is ``wire.responses``).

Output items: ``reasoning``, ``message`` with
``output_text``, ``function_call``; their ids derive from the node id, so a stored
response reads back identically. Extensions: ``finish_reason``, ``prompt_token_ids``,
``token_ids`` and ``policy_versions`` (which policy version sampled which of ``token_ids``:
``{"version", "start", "end"}`` half-open spans over them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout_proxy.records import ResponseNode, SessionRecord


def output_items(node: ResponseNode) -> list[dict[str, Any]]:
    """The node's output as Responses items; a call to a namespace's function carries its ``namespace``."""
    message = node.messages[-1]
    namespaces = node.meta.get("tool_namespaces") or {}
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
        name = call["function"]["name"]
        item = {
            "type": "function_call",
            "id": f"fc_{suffix}_{index}",
            "call_id": call["id"],
            "name": name,
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        if name in namespaces:
            item["namespace"] = namespaces[name]
        items.append(item)
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
        "tool_choice": node.meta.get("tool_choice", "auto"),
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
        "policy_versions": [span.to_dict() for span in node.policy_versions],
    }
