"""What every handler needs first: who is calling, and for plugins, their session; what a turn's node
records of its request (``turn_meta``). A generation request itself is taken in by ``proxy.intake``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from rollout_proxy.core.branches import BRANCH_HEADER, BRANCH_METADATA_KEY, branch_label
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.auth import Caller, authenticate
from rollout_proxy.wire.messages import ToolSet

if TYPE_CHECKING:
    from rollout_proxy.proxy.intake import Taken


def request_caller(request: web.Request, *, admin_only: bool = False) -> Caller:
    app = request.app
    found = authenticate(
        request, admin_key=app[keys.SETTINGS].admin_key, tokens=app[keys.TOKENS], admin_only=admin_only
    )
    if found.session_id is not None:
        structlog.contextvars.bind_contextvars(session_id=found.session_id)
    return found


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
