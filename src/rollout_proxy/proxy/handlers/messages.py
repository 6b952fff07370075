"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (the Anthropic Messages API) for plugins.

Served at the proxy's root (Anthropic's clients append ``/v1/messages`` to their base URL) and under the
session's ``base_url`` (``…/v1``, hence ``/v1/v1/messages``); ``?beta=true`` and the ``anthropic-version``
/ ``anthropic-beta`` headers are accepted and change nothing. The session key comes in ``x-api-key`` or
``Authorization: Bearer`` (``proxy.auth``); errors are Anthropic's shape (``proxy.middleware``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import orjson
from aiohttp import web

from rollout_proxy.core.messages import API, THREAD_TOOLS, MessagesPlacement, Thread
from rollout_proxy.core.tree import match_window
from rollout_proxy.core.turn_service import Ask
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.ids import session_of_response
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.anthropic_answers import message_body, signed_node, signing_key
from rollout_proxy.proxy.anthropic_models import CountTokensRequest, MessagesRequest
from rollout_proxy.proxy.client_sampling import MESSAGES_FIELDS
from rollout_proxy.proxy.handlers.turn import TurnPlan, serve_turn, turn_meta
from rollout_proxy.proxy.http import json_response
from rollout_proxy.proxy.intake import Spec, Taken, take_in
from rollout_proxy.proxy.messages_stream import MessageEvents
from rollout_proxy.proxy.resent_history import HistoryIntake
from rollout_proxy.state.store import ReadAhead
from rollout_proxy.tokenization.messages import path_hashes
from rollout_proxy.wire.anthropic import Conversation, conversation, split_tools, stop_sequences, system_message
from rollout_proxy.wire.images import ImageSet

MR = TypeVar("MR", bound=CountTokensRequest)


@dataclass(frozen=True, slots=True)
class MessagesConversation:
    """A request's conversation in the normal form (with its signed thinking), and its path hashes."""

    conversation: Conversation
    hashes: list[str]  # none on a thread: the parent is named

    @property
    def images(self) -> ImageSet:
        """The images the conversation holds."""
        images = self.conversation.images
        assert images is not None  # a conversation the proxy folds holds its images
        return images

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


def _thread(body: CountTokensRequest) -> str | None:
    return body.previous_message_id if isinstance(body, MessagesRequest) else None


def _normalized(
    body: CountTokensRequest, history: HistoryIntake | None, urls: Mapping[str, bytes] | None
) -> MessagesConversation:
    """The conversation folded message by message (only what the memory has not seen: a resent history is
    folded once, when its ``system`` is the same); on a thread, the system is the thread's (checked against
    it later), not a new message."""
    previous = _thread(body)
    system = None if previous else body.system
    hashes = None
    if history is not None:
        context = b"thread" if previous else orjson.dumps(system)
        folded = history.take(body.messages, lambda: Conversation.starting(system), context=context, urls=urls)
        found, hashes = folded.fold, folded.hashes
    else:
        found = conversation(system, body.messages, images=ImageSet(urls=urls))
    messages = found.messages
    if messages[-1]["role"] == "assistant":
        raise InvalidRequest(
            "the last message is the assistant's: continuing a partial assistant turn (a prefill) is not "
            "supported; end the conversation with a user message or tool results",
            param=f"messages[{len(body.messages) - 1}]",
        )
    if previous is not None:
        return MessagesConversation(found, [])
    return MessagesConversation(found, path_hashes(messages) if hashes is None else hashes)


def _read_ahead(body: CountTokensRequest, read: MessagesConversation) -> ReadAhead:
    """The node a thread continues from, or the path-index entries the tree looks up first."""
    previous = _thread(body)
    return ReadAhead(response_id=previous) if previous is not None else ReadAhead(hashes=match_window(read.hashes))


def _spec(model: type[MR]) -> Spec[MR, MessagesConversation]:
    """How a Messages request is taken in (``proxy.intake``): a resent history checked and folded once."""
    return Spec(
        model=model,
        api=API,
        key="messages",
        sampling=MESSAGES_FIELDS if model is MessagesRequest else (),
        normalize=_normalized,
        read_ahead=_read_ahead,
    )


MESSAGES = _spec(MessagesRequest)  # what a turn takes in
COUNT_TOKENS = _spec(CountTokensRequest)


def _plan(request: web.Request, call: Taken[MessagesRequest, MessagesConversation]) -> TurnPlan:
    """The turn a Messages request asks for, placed by content and signed thinking, or on a thread
    (``core.messages``)."""
    session, body, read = call.session, call.body, call.conversation
    key = signing_key(request.app[keys.SETTINGS].token_secret)
    signed = read.signed(key, session.id)
    toolset = call.tool_set(split_tools)
    meta = turn_meta(request, API, call, toolset)
    thread = None
    if body.previous_message_id is not None:
        system = system_message(body.system)
        thread = Thread(body.previous_message_id, None if system is None else system["content"])
    if body.thread is not None and toolset.functions is not None:  # a thread's later turns may leave them out
        meta[THREAD_TOOLS] = toolset.functions
    return TurnPlan(
        Ask(
            read.conversation.messages,
            tools=toolset.functions,
            stop=stop_sequences(body.stop_sequences),
            meta=meta,
            images=read.images.checked(),
        ),
        MessagesPlacement(hashes=read.hashes or None, signed=signed, thread=thread),
        stream=bool(body.stream),
        body=lambda result: message_body(result, model=body.model, key=key),
        framing=lambda started: MessageEvents(started, model=body.model, key=key),
    )


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve_turn(request, MESSAGES, _plan)


async def count_tokens(request: web.Request) -> web.Response:
    """A turn's placement and prompt, nothing sampled (``TurnService.count_tokens``)."""
    call = await take_in(request, COUNT_TOKENS)
    async with call.lease:
        read = call.conversation
        signed = read.signed(signing_key(request.app[keys.SETTINGS].token_secret), call.session.id)
        count = await request.app[keys.TURNS].count_tokens(
            call.lease,
            Ask(read.conversation.messages, tools=call.tool_set(split_tools).functions, images=read.images.checked()),
            MessagesPlacement(hashes=read.hashes, signed=signed),
        )
    return json_response({"input_tokens": count})
