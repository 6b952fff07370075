"""``POST /v1/chat/completions`` for plugins (session token)."""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from rollout_proxy.core.turns import TurnResult
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.chat_stream import ChatChunks, include_usage
from rollout_proxy.proxy.handlers.common import plugin_request
from rollout_proxy.proxy.http import json_response
from rollout_proxy.proxy.schemas import ChatRequest
from rollout_proxy.proxy.sse import serve_stream
from rollout_proxy.state.store import ReadAhead
from rollout_proxy.tokenization.messages import path_hashes
from rollout_proxy.wire.messages import normalize_messages, normalize_tools


def completion_body(result: TurnResult, *, model: str | None, logprobs: bool | None) -> dict[str, Any]:
    node, view = result.node, result.view
    message: dict[str, Any] = {"role": "assistant", "content": view.content}
    if view.tool_calls:
        message["tool_calls"] = view.tool_calls
    if view.reasoning:
        message["reasoning_content"] = view.reasoning
        message["reasoning"] = view.reasoning
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": node.finish_reason,
        "logprobs": None,
        "token_ids": node.output_ids,
    }
    if logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{token}", "logprob": float(logprob), "bytes": None, "top_logprobs": []}
                for token, logprob in zip(node.output_ids.tolist(), node.output_logprobs.tolist(), strict=True)
            ]
        }
    return {
        "id": node.id,
        "object": "chat.completion",
        "created": int(node.created_at),
        "model": model or node.model,
        "choices": [choice],
        "usage": node.usage,
        "prompt_token_ids": result.prompt_ids,
        "system_fingerprint": None,
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    normalized: list[list[dict[str, Any]]] = []
    hashed: list[tuple[str, ...]] = []

    def read_ahead(body: ChatRequest) -> ReadAhead:
        """The path-index entries the turn attaches by (read with its session: one round trip)."""
        if body.top_logprobs:
            raise InvalidRequest(
                "top_logprobs is not supported; logprobs=true returns the sampled ones", param="top_logprobs"
            )
        normalized.append(normalize_messages(body.messages))
        hashed.append(tuple(path_hashes(normalized[0])))  # computed once: the tree attaches by the same hashes
        return ReadAhead(hashes=hashed[0])

    session, body = await plugin_request(request, ChatRequest, read_ahead=read_ahead)
    messages, hashes = normalized[0], hashed[0]
    tools = normalize_tools(body.tools)
    if body.stream:
        usage = include_usage(body.model_extra)
        events = request.app[keys.CHAT].stream(session, messages, tools=tools, stop=body.stop_list(), hashes=hashes)
        return await serve_stream(
            request,
            events,
            lambda started: ChatChunks(started, model=body.model, usage=usage, logprobs=bool(body.logprobs)),
        )
    result = await request.app[keys.CHAT].complete(session, messages, tools=tools, stop=body.stop_list(), hashes=hashes)
    structlog.contextvars.bind_contextvars(response_id=result.node.id)
    return json_response(completion_body(result, model=body.model, logprobs=body.logprobs))
