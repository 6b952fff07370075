"""``POST /v1/chat/completions`` for plugins (session token)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rollout_proxy.core.chat import ChatPlacement
from rollout_proxy.core.tree import match_window
from rollout_proxy.core.turn_service import Ask
from rollout_proxy.core.turns import TurnResult
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy.chat_stream import ChatChunks, include_usage
from rollout_proxy.proxy.client_sampling import CHAT_FIELDS
from rollout_proxy.proxy.handlers.turn import TurnPlan, serve_turn, turn_meta
from rollout_proxy.proxy.intake import Spec, Taken
from rollout_proxy.proxy.resent_history import HistoryIntake
from rollout_proxy.proxy.schemas import ChatRequest
from rollout_proxy.state.store import ReadAhead
from rollout_proxy.tokenization.messages import path_hashes
from rollout_proxy.wire.images import ImageSet
from rollout_proxy.wire.messages import MessageFold, split_tools


def completion_body(result: TurnResult, *, model: str | None, logprobs: bool | None, top: int = 0) -> dict[str, Any]:
    """``top``: how many of the session's recorded top-k rows to show per token (OpenAI's ``top_logprobs``)."""
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
        topk = node.output_topk  # the session's recorded top-k (``top_logprobs`` at create)
        rows: list[list[dict[str, Any]]] = (
            [[] for _ in range(len(node.output_ids))]
            if topk is None or not top
            else [
                [{"token": f"token_id:{t}", "logprob": v, "bytes": None} for t, v in zip(ids, values, strict=True)]
                for ids, values in zip(topk.ids[:, :top].tolist(), topk.logprobs[:, :top].tolist(), strict=True)
            ]
        )
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{token}", "logprob": float(logprob), "bytes": None, "top_logprobs": row}
                for token, logprob, row in zip(
                    node.output_ids.tolist(), node.output_logprobs.tolist(), rows, strict=True
                )
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


@dataclass(frozen=True, slots=True)
class ChatConversation:
    messages: list[dict[str, Any]]  # normalized
    hashes: tuple[str, ...]  # their rolling path hashes (the tree attaches by them)
    images: ImageSet  # the images they hold


def _normalized(body: ChatRequest, history: HistoryIntake | None, urls: Mapping[str, bytes] | None) -> ChatConversation:
    """The messages' normal forms and path hashes: only those the memory has not seen computed."""
    if history is not None:
        folded = history.take(body.messages, MessageFold, urls=urls)
        return ChatConversation(list(folded.fold.messages), tuple(folded.hashes), folded.fold.images)
    fold = MessageFold(images=ImageSet(urls=urls))
    for index, message in enumerate(body.messages):
        fold.add(message, f"messages[{index}]")
    return ChatConversation(fold.messages, tuple(path_hashes(fold.messages)), fold.images)


#: how a Chat Completions request is taken in (``proxy.intake``)
CHAT = Spec(
    model=ChatRequest,
    api="chat",
    key="messages",
    sampling=CHAT_FIELDS,
    normalize=_normalized,
    read_ahead=lambda body, conversation: ReadAhead(hashes=match_window(conversation.hashes)),
)


def _plan(request: web.Request, call: Taken[ChatRequest, ChatConversation]) -> TurnPlan:
    """The turn a Chat Completions request asks for, placed by content (``core.chat``)."""
    session, body = call.session, call.body
    recorded = session.generation.top_logprobs
    if body.top_logprobs and (body.top_logprobs > recorded or body.stream):
        raise InvalidRequest(
            f"top_logprobs {body.top_logprobs} needs a session that records at least that many (it records "
            f"{recorded}: set generation.top_logprobs when the session is created), and no stream; "
            "logprobs=true alone returns the sampled ones",
            param="top_logprobs",
        )
    toolset = call.tool_set(split_tools)
    meta = turn_meta(request, "chat", call, toolset)
    usage = include_usage(body.model_extra) if body.stream else False
    return TurnPlan(
        Ask(
            call.conversation.messages,
            tools=toolset.functions,
            stop=body.stop_list(),
            meta=meta,
            images=call.conversation.images.checked(),
        ),
        ChatPlacement(hashes=call.conversation.hashes),
        stream=bool(body.stream),
        body=lambda result: completion_body(
            result, model=body.model, logprobs=body.logprobs, top=body.top_logprobs or 0
        ),
        framing=lambda started: ChatChunks(started, model=body.model, usage=usage, logprobs=bool(body.logprobs)),
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve_turn(request, CHAT, _plan)
