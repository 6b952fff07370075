"""One handler shape for the three APIs' turns (``serve_turn``): the request taken in (``proxy.intake``),
planned by its API (what it asks of the turn, where the turn goes, how the answer is shaped: a
``TurnPlan``), then served by the one turn service, answered whole or streamed (``proxy.sse``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from pydantic import BaseModel

from rollout_proxy.core.branches import BRANCH_HEADER, BRANCH_METADATA_KEY, branch_label
from rollout_proxy.core.streaming import TurnStarted
from rollout_proxy.core.turn_service import Ask, Placing
from rollout_proxy.core.turns import TurnResult
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.http import json_response
from rollout_proxy.proxy.intake import C, Spec, Taken, take_in
from rollout_proxy.proxy.sse import Framing, serve_stream
from rollout_proxy.proxy.validation import M
from rollout_proxy.wire.messages import ToolSet


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """One request's turn, as its API plans it: what it asks, where it goes (the API's ``Placing``), whether
    it streams, and how the answer is shaped: its body, or its SSE frames."""

    ask: Ask
    placing: Placing
    stream: bool
    body: Callable[[TurnResult], dict[str, Any]]
    framing: Callable[[TurnStarted], Framing]


#: an API's planner: the request and what the intake took in, to its turn's plan (refusals raise here)
Planner = Callable[[web.Request, Taken[M, C]], TurnPlan]


async def serve_turn(request: web.Request, spec: Spec[M, C], plan: Planner[M, C]) -> web.StreamResponse:
    """Take the request in, plan its turn, serve it: the answer whole, or streamed."""
    call = await take_in(request, spec)
    async with call.lease:  # its slot goes back with the node's write, else here
        planned = plan(request, call)
        turns = request.app[keys.TURNS]
        if planned.stream:
            events = await turns.stream(call.lease, planned.ask, planned.placing)
            return await serve_stream(request, events, planned.framing)
        result = await turns.complete(call.lease, planned.ask, planned.placing)
    structlog.contextvars.bind_contextvars(response_id=result.node.id)
    return json_response(planned.body(result))


def _branch_label(request: web.Request, body: Any) -> str | None:
    """The label a request gives its branch (``core.branches``): the ``X-Rollout-Branch`` header, or the
    ``rollout_branch`` key of the body's ``metadata``; a bad one is a 400."""
    extra = getattr(body, "model_extra", None) or {}
    metadata = getattr(body, "metadata", None) or extra.get("metadata")
    try:
        return branch_label(request.headers.get(BRANCH_HEADER), metadata)
    except ValueError as exc:
        param = BRANCH_HEADER if BRANCH_HEADER in request.headers else f"metadata.{BRANCH_METADATA_KEY}"
        raise InvalidRequest(str(exc), param=param) from None


def turn_meta(request: web.Request, api: str, call: Taken[Any, Any], tools: ToolSet) -> dict[str, Any]:
    """What a turn's node records of its request beyond its messages, counted: the generation parameters
    the session ignored (``client_sampling``), the tools left out of the prompt (``tools_left_out``) and
    which rendered functions belong to a namespace (``tool_namespaces``: their calls go back with it), and a
    ``tool_choice`` that asks for more than ``auto`` (accepted, not enforced: the policy samples freely)."""
    metrics = request.app[keys.METRICS]
    meta: dict[str, Any] = {}
    choice = getattr(call.body, "tool_choice", None)
    if isinstance(choice, BaseModel):  # the Messages API's, checked by its model
        choice = choice.model_dump(exclude_none=True)
    if choice is not None and (choice if isinstance(choice, str) else choice.get("type")) != "auto":
        meta["tool_choice"] = choice
    label = _branch_label(request, call.body)
    if label is not None:
        meta["branch_label"] = label
    if call.client_sampling:
        meta["client_sampling"] = call.client_sampling
        for name in call.client_sampling:
            metrics.inc("client_sampling_ignored_total", api=api, field=name)
    if tools.left_out:
        meta["tools_left_out"] = tools.left_out
        for tool in tools.left_out:
            metrics.inc("tools_left_out_total", api=api, type=tool["type"])
    if tools.namespaces:
        meta["tool_namespaces"] = tools.namespaces
    return meta
