"""A plugin's generation request, taken in once: its stages in order, each in a module of its own.

    1 read       the body's bytes, bounded                                 ``proxy.http.read_body``
    2 parse      a JSON object (the list memory may parse only what is new)  ``proxy.limits``, the memory
    3 known      which items of the body's list (and whether its tools) were checked before   the memory
    4 limits     depth and string bounds, on the rest                        ``proxy.limits``
    5 validate   the API's request model, on the rest                        ``proxy.validation``
   5b fetch      its image URLs' bytes (only with ``--image-urls``)          ``proxy.images``
    6 normalize  the API's conversation: normal forms, keys, path hashes     the API's ``Spec.normalize``
   6b images     the images it adds decoded and checked (Pillow), counted    ``proxy.images``
    7 session    the open session, read with what the turn reads next        ``core.sessions`` (one round trip)
    8 sampling   the generation parameters sent, against ``client_sampling``   ``proxy.client_sampling``

Each stage runs once and hands on what it made; nothing goes back to an earlier one. The list memory
(``proxy.resent_history``: chat ``messages``, Responses ``input``, the Messages API's ``messages``) spares a
resent history its parse, checks and normalization, and remembers the body only once it is taken in whole,
its session checked open; it is the one stage that can be switched off (``--resent-history check``): every
body is then taken in whole, and a test holds both ways to the same result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from aiohttp import web

from rollout_proxy.errors import AuthenticationFailed
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.client_sampling import SamplingField, check_client_sampling
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import read_body
from rollout_proxy.proxy.limits import check_json_limits, load_json_object
from rollout_proxy.proxy.resent_history import HistoryIntake
from rollout_proxy.proxy.validation import CHECK_ITEMS, TOOLS_CHECKED, M, validate
from rollout_proxy.records import SessionRecord
from rollout_proxy.state.store import ReadAhead, SessionLease
from rollout_proxy.wire.images import ImageSet
from rollout_proxy.wire.messages import ToolSet


class Imaged(Protocol):
    """A conversation taken in: it holds its images (``wire.images``)."""

    @property
    def images(self) -> ImageSet: ...


C = TypeVar("C", bound=Imaged)
#: ``--resent-history``: "reuse" what the list memory holds, or "check" every body whole
RESENT_HISTORY_MODES = ("reuse", "check")


@dataclass(frozen=True, slots=True)
class Spec(Generic[M, C]):
    """How one API's requests are taken in."""

    model: type[M]
    api: str  # whose lists the memory keeps: "chat", "responses" or "messages"
    key: str  # the body's long list: "messages" or "input"
    sampling: tuple[SamplingField, ...]  # the API's generation parameters (``proxy.client_sampling``)
    #: the conversation of a validated body (with the memory's view of its list, or None: taken whole), its URL
    #: images' bytes as fetched (None: URLs are refused)
    normalize: Callable[[M, HistoryIntake | None, Mapping[str, bytes] | None], C]
    #: what the turn reads right after the session (read with it, in the same round trip)
    read_ahead: Callable[[M, C], ReadAhead | None]


@dataclass(frozen=True, slots=True)
class Taken(Generic[M, C]):
    """A plugin's generation request, taken in: its open session (read for the turn: ``lease``, which the
    caller closes), its body and conversation, and the generation parameters it sent that the session
    ignores (``client_sampling: ignore``; recorded)."""

    lease: SessionLease
    body: M
    conversation: C
    client_sampling: dict[str, Any]
    history: HistoryIntake | None = None  # the resent-history memory's view of the request (None: off)

    @property
    def session(self) -> SessionRecord:
        return self.lease.session

    def tool_set(self, split: Callable[[Any], ToolSet]) -> ToolSet:
        """The body's tools as ``split`` (its API's) gives them for the policy; split once per tools JSON
        where the resent-history memory is on (``HistoryIntake.tool_set``). Shared: never changed."""
        tools = getattr(self.body, "tools", None)
        return split(tools) if self.history is None else self.history.tool_set(tools, split)


async def take_in(request: web.Request, spec: Spec[M, C]) -> Taken[M, C]:
    """The stages of the module docstring, in order."""
    caller = request_caller(request)
    if caller.session_id is None:
        raise AuthenticationFailed("this endpoint needs a session token, not the admin key")
    session_id, expires_at = caller.session_id, caller.expires_at
    raw = await read_body(request)  # 1
    history = (
        request.app[keys.RESENT_HISTORY].intake(spec.api, spec.key, session_id, expires_at=expires_at)
        if request.app[keys.SETTINGS].resent_history == "reuse"
        else None
    )
    payload = load_json_object(raw) if history is None else history.load(raw)  # 2
    to_check = None if history is None else history.look_up(payload.get(spec.key))  # 3
    tools_checked = history is not None and history.tools_checked(payload.get("tools"))
    check_json_limits(
        payload, messages_to_check=to_check, key=spec.key, checked=("tools",) if tools_checked else ()
    )  # 4
    context: dict[str, Any] = {} if to_check is None else {CHECK_ITEMS: to_check}
    if tools_checked:
        context[TOOLS_CHECKED] = True
    body = validate(spec.model, payload, context=context or None)  # 5
    images = request.app[keys.IMAGES]
    urls = await images.fetch(payload.get(spec.key), spec.key, session_id=session_id, until=expires_at)  # 5b
    conversation = spec.normalize(body, history, urls)  # 6
    await images.check(conversation.images, key=spec.key)  # 6b
    ahead = spec.read_ahead(body, conversation)
    if caller.bound is not None:  # the session's request bound: its slot taken in the same round trip
        ahead = dataclasses.replace(ahead or ReadAhead(), bound=caller.bound)
    lease = await request.app[keys.SESSIONS].lease_open(session_id, ahead or ReadAhead())  # 7
    try:
        session = lease.session
        asked = check_client_sampling(payload, session.generation, spec.sampling, mode=session.client_sampling)  # 8
    except BaseException:
        await lease.close()
        raise
    if history is not None:  # taken in whole, its session open: remembered for the next turns
        history.commit()
    return Taken(lease, body, conversation, asked, history)
