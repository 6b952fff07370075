"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (the Anthropic Messages API) for plugins.

Served at the proxy's root (Anthropic's clients append ``/v1/messages`` to their base URL) and under the
session's ``base_url`` (``…/v1``, hence ``/v1/v1/messages``); ``?beta=true`` and the ``anthropic-version``
/ ``anthropic-beta`` headers are accepted and change nothing. The session key comes in ``x-api-key`` or
``Authorization: Bearer`` (``proxy.auth``); errors are Anthropic's shape (``proxy.middleware``).
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from rollout_proxy.core.messages import API, THREAD_TOOLS, Thread
from rollout_proxy.core.tree import match_window
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.ids import session_of_response
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.anthropic_answers import message_body, signed_node, signing_key
from rollout_proxy.proxy.anthropic_models import CountTokensRequest, MessagesRequest
from rollout_proxy.proxy.client_sampling import MESSAGES_FIELDS
from rollout_proxy.proxy.handlers.common import plugin_request, turn_meta
from rollout_proxy.proxy.http import json_response
from rollout_proxy.proxy.messages_stream import MessageEvents
from rollout_proxy.proxy.sse import serve_stream
from rollout_proxy.state.store import ReadAhead
from rollout_proxy.tokenization.messages import path_hashes
from rollout_proxy.wire.anthropic import Conversation, conversation, split_tools, stop_sequences, system_message


class _Read:
    """The conversation of a request's body, normalized and hashed once (before the session read)."""

    def __init__(self) -> None:
        self.conversation = Conversation(messages=[])
        self.hashes: list[str] = []

    def __call__(self, body: CountTokensRequest) -> ReadAhead:
        previous = body.previous_message_id if isinstance(body, MessagesRequest) else None
        # on a thread, the system is the thread's (checked against it), not a new message
        self.conversation = conversation(None if previous else body.system, body.messages)
        messages = self.conversation.messages
        if messages[-1]["role"] == "assistant":
            raise InvalidRequest(
                "the last message is the assistant's: continuing a partial assistant turn (a prefill) is not "
                "supported; end the conversation with a user message or tool results",
                param=f"messages[{len(body.messages) - 1}]",
            )
        if previous is not None:
            return ReadAhead(response_id=previous)  # the node the thread continues from, with the session
        self.hashes = path_hashes(messages)
        return ReadAhead(hashes=match_window(self.hashes))  # what the tree looks up first

    def signed(self, key: bytes, session_id: str) -> list[tuple[int, str]]:
        """(message index, node id) of every signed thinking block; a signature this proxy did not issue for
        this text in this session is refused (a block must be echoed unchanged, or sent without one)."""
        found = []
        for block in self.conversation.signed:
            node_id = signed_node(key, block.signature, block.thinking)
            if node_id is None or session_of_response(node_id) != session_id:
                raise InvalidRequest(
                    "this thinking block's signature was not issued by this proxy for this text in this session: "
                    "echo thinking blocks unchanged, or send reasoning of your own without a signature",
                    param=block.param,
                    code="invalid_thinking_signature",
                )
            found.append((block.message, node_id))
        return found


async def create_message(request: web.Request) -> web.StreamResponse:
    read = _Read()
    call = await plugin_request(request, MessagesRequest, sampling=MESSAGES_FIELDS, read_ahead=read)
    session, body = call.session, call.body
    key = signing_key(request.app[keys.SETTINGS].token_secret)
    signed = read.signed(key, session.id)
    toolset = split_tools(body.tools)
    meta = turn_meta(request, API, call, toolset)
    if body.tool_choice is not None and body.tool_choice.type != "auto":  # asked for, not enforced: recorded
        meta["tool_choice"] = body.tool_choice.model_dump(exclude_none=True)
    thread = None
    if body.previous_message_id is not None:
        system = system_message(body.system)
        thread = Thread(body.previous_message_id, None if system is None else system["content"])
    if body.thread is not None and toolset.functions is not None:  # a thread's later turns may leave them out
        meta[THREAD_TOOLS] = toolset.functions
    arguments: dict[str, Any] = {
        "tools": toolset.functions,
        "stop": stop_sequences(body.stop_sequences),
        "hashes": read.hashes or None,
        "signed": signed,
        "thread": thread,
        "meta": meta,
    }
    service = request.app[keys.MESSAGES]
    if body.stream:
        events = service.stream(session, read.conversation.messages, **arguments)
        return await serve_stream(request, events, lambda started: MessageEvents(started, model=body.model, key=key))
    result = await service.complete(session, read.conversation.messages, **arguments)
    structlog.contextvars.bind_contextvars(response_id=result.node.id)
    return json_response(message_body(result, model=body.model, key=key))


async def count_tokens(request: web.Request) -> web.Response:
    read = _Read()
    call = await plugin_request(request, CountTokensRequest, sampling=(), read_ahead=read)
    session, body = call.session, call.body
    signed = read.signed(signing_key(request.app[keys.SETTINGS].token_secret), session.id)
    count = await request.app[keys.MESSAGES].count_tokens(
        session, read.conversation.messages, tools=split_tools(body.tools).functions, hashes=read.hashes, signed=signed
    )
    return json_response({"input_tokens": count})
