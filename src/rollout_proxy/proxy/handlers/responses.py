"""``POST /v1/responses`` and ``GET /v1/responses/{id}`` for plugins."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollout_proxy.core.responses import ResponsesPlacement
from rollout_proxy.core.tree import match_window
from rollout_proxy.core.turn_service import Ask
from rollout_proxy.core.turns import path_tokens
from rollout_proxy.errors import NotFound
from rollout_proxy.ids import session_of_response
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.client_sampling import RESPONSES_FIELDS
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.handlers.turn import TurnPlan, serve_turn, turn_meta
from rollout_proxy.proxy.http import json_response
from rollout_proxy.proxy.intake import Spec, Taken
from rollout_proxy.proxy.openai_responses import response_body
from rollout_proxy.proxy.resent_history import HistoryIntake
from rollout_proxy.proxy.responses_stream import ResponseEvents
from rollout_proxy.proxy.schemas import ResponsesRequest
from rollout_proxy.state.store import ReadAhead
from rollout_proxy.wire.images import ImageSet
from rollout_proxy.wire.messages import split_tools
from rollout_proxy.wire.responses import InputFold, input_to_messages


@dataclass(frozen=True, slots=True)
class InputConversation:
    messages: list[dict[str, Any]]  # the input's items folded into normalized messages
    keys: list[bytes] | None  # their canonical keys (None: the tree computes them)
    hashes: list[str] | None = None  # their rolling path hashes, with the keys (the memory kept them)
    images: ImageSet = field(default_factory=ImageSet)  # the images they hold


def _folded(
    body: ResponsesRequest, history: HistoryIntake | None, urls: Mapping[str, bytes] | None
) -> InputConversation:
    """The input as messages: a list folded item by item (only what the memory has not seen), a string as
    one user message."""
    if type(body.input) is list and history is not None:
        folded = history.take(body.input, InputFold, urls=urls)
        images = folded.fold.images
        assert images is not None  # a fold the proxy keeps holds its images
        return InputConversation(folded.fold.messages, folded.keys, folded.hashes, images)
    images = ImageSet(urls=urls)
    return InputConversation(input_to_messages(body.input, images=images), None, images=images)


def _read_ahead(body: ResponsesRequest, conversation: InputConversation) -> ReadAhead:
    """The node ``previous_response_id`` names; else, for a resent input placed as sent (no instructions put
    first), the path-index entries the tree looks up first, so a store reads them and their path with the
    session (``core.tree.ResponseTree.locate``)."""
    if body.previous_response_id is not None:
        return ReadAhead(response_id=body.previous_response_id)
    if conversation.hashes is None or body.instructions:
        return ReadAhead()
    return ReadAhead(hashes=match_window(conversation.hashes))


#: how a Responses request is taken in (``proxy.intake``)
RESPONSES = Spec(
    model=ResponsesRequest,
    api="responses",
    key="input",
    sampling=RESPONSES_FIELDS,
    normalize=_folded,
    read_ahead=_read_ahead,
)


def _plan(request: web.Request, call: Taken[ResponsesRequest, InputConversation]) -> TurnPlan:
    """The turn a Responses request asks for, placed by ``previous_response_id`` or by content
    (``core.responses``)."""
    session, body = call.session, call.body
    toolset = call.tool_set(split_tools)
    tools = toolset.functions
    return TurnPlan(
        Ask(
            call.conversation.messages,
            tools=tools,
            meta=turn_meta(request, "responses", call, toolset),
            images=call.conversation.images.checked(),
        ),
        ResponsesPlacement(
            previous_response_id=body.previous_response_id,
            instructions=body.instructions,
            store=body.store,
            keys=call.conversation.keys,
            hashes=call.conversation.hashes,
        ),
        stream=bool(body.stream),
        body=lambda result: response_body(
            result.node, prompt_ids=result.prompt_ids, session=session, tools=tools or session.tools, model=body.model
        ),
        framing=lambda started: ResponseEvents(
            started, session=session, tools=tools or session.tools, model=body.model
        ),
    )


async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve_turn(request, RESPONSES, _plan)  # a resent input's items are checked once


async def get_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    owner = session_of_response(response_id)
    if owner is None:
        raise NotFound(f"response {response_id!r} not found", param="response_id")
    request_caller(request).require_session(owner)
    session = await request.app[keys.SESSIONS].get(owner)
    path = await request.app[keys.TREE].path(owner, response_id, param="response_id")
    node = path[-1]
    if node.api != "responses" or not node.meta.get("store", True):
        raise NotFound(f"response {response_id!r} not found (not a stored Responses API response)", param="response_id")
    prompt = path_tokens(path)[: -len(node.output_ids) or None]
    tools = node.meta.get("tools", session.tools)
    return json_response(response_body(node, prompt_ids=prompt, session=session, tools=tools))
