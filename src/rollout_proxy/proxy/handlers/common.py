"""What every handler needs first: who is calling, and for plugins, their session."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol

import structlog
from aiohttp import web

from rollout_proxy.core.branches import BRANCH_HEADER, BRANCH_METADATA_KEY, branch_label
from rollout_proxy.errors import AuthenticationFailed, InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import Caller, authenticate
from rollout_proxy.proxy.client_sampling import SamplingField, check_client_sampling
from rollout_proxy.proxy.http import read_body
from rollout_proxy.proxy.limits import check_json_limits, load_json_object
from rollout_proxy.proxy.validation import CHECK_ITEMS, M, validate
from rollout_proxy.records import SessionRecord
from rollout_proxy.state.store import ReadAhead
from rollout_proxy.wire.messages import ToolSet


def request_caller(request: web.Request, *, admin_only: bool = False) -> Caller:
    app = request.app
    found = authenticate(
        request, admin_key=app[keys.SETTINGS].admin_key, tokens=app[keys.TOKENS], admin_only=admin_only
    )
    if found.session_id is not None:
        structlog.contextvars.bind_contextvars(session_id=found.session_id)
    return found


async def plugin_session(request: web.Request, *, read_ahead: ReadAhead | None = None) -> SessionRecord:
    """The open session named by the caller's token (plugin routes need one)."""
    found = request_caller(request)
    if found.session_id is None:
        raise AuthenticationFailed("this endpoint needs a session token, not the admin key")
    return await request.app[keys.SESSIONS].get_open(found.session_id, read_ahead=read_ahead)


class BodyIntake(Protocol):
    """How a body's long list (``key``: Chat's ``messages``, Responses' ``input``) is read: the parts a
    session sent before are not checked again (``proxy.known_messages``, ``proxy.known_input``)."""

    key: str

    def load(self, body: bytes, *, session_id: str | None = None) -> dict[str, Any]: ...

    def look_up(
        self, items: Any, *, session_id: str | None = None, expires_at: float = 0.0
    ) -> tuple[int, ...] | None: ...


@dataclass(frozen=True, slots=True)
class PluginCall(Generic[M]):
    """A plugin's generation request, read and checked: its open session, its body, and the generation
    parameters it sent that the session ignores (``client_sampling: ignore``; recorded on the node)."""

    session: SessionRecord
    body: M
    client_sampling: dict[str, Any]


async def plugin_request(
    request: web.Request,
    model: type[M],
    *,
    sampling: tuple[SamplingField, ...],
    read_ahead: Callable[[M], ReadAhead | None] | None = None,
    intake: BodyIntake | None = None,
) -> PluginCall[M]:
    """A plugin's generation request: its open session, the body, and what the client asked of the
    generation parameters (``sampling``: the API's table, ``proxy.client_sampling``), checked against the
    session's ``client_sampling`` setting once the session is read (refused there, or returned).

    With ``read_ahead``, the body is checked first and the session read with what the turn reads next
    and, when the token names the session's request bound, the bound's slot taken (one store round trip
    for all: ``state.store.ReadAhead``). With ``intake``, the body's messages already known to the app
    are not checked again (``proxy.known_messages``)."""
    found = request_caller(request)
    if found.session_id is None:
        raise AuthenticationFailed("this endpoint needs a session token, not the admin key")
    if read_ahead is None:
        session = await request.app[keys.SESSIONS].get_open(found.session_id)
        payload, body = await _plugin_body(request, model, intake, session.id, session.expires_at)
    else:
        payload, body = await _plugin_body(request, model, intake, found.session_id, found.expires_at)
        ahead = read_ahead(body)
        if found.bound is not None:
            ahead = dataclasses.replace(ahead or ReadAhead(), bound=found.bound)
        session = await request.app[keys.SESSIONS].get_open(found.session_id, read_ahead=ahead)
    asked = check_client_sampling(payload, session.generation, sampling, mode=session.client_sampling)
    return PluginCall(session, body, asked)


async def _plugin_body(
    request: web.Request,
    model: type[M],
    intake: BodyIntake | None = None,
    session_id: str | None = None,
    expires_at: float = 0.0,
) -> tuple[dict[str, Any], M]:
    """The request's body as parsed and as ``model``; with ``intake``, the items of its list it knows are
    not checked again (the limits walk and the shape check skip them), and what it learns is kept until
    the session's expiry at most."""
    body = await read_body(request)
    payload = load_json_object(body) if intake is None else intake.load(body, session_id=session_id)
    key = "messages" if intake is None else intake.key
    to_check = (
        None if intake is None else intake.look_up(payload.get(key), session_id=session_id, expires_at=expires_at)
    )
    check_json_limits(payload, messages_to_check=to_check, key=key)
    return payload, validate(model, payload, context=None if to_check is None else {CHECK_ITEMS: to_check})


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


def turn_meta(request: web.Request, api: str, call: PluginCall[Any], tools: ToolSet) -> dict[str, Any]:
    """What a turn's node records of its request beyond its messages, counted: the generation parameters
    the session ignored (``client_sampling``), the tools left out of the prompt (``tools_left_out``) and
    which rendered functions belong to a namespace (``tool_namespaces``: their calls go back with it)."""
    metrics = request.app[keys.METRICS]
    meta: dict[str, Any] = {}
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
