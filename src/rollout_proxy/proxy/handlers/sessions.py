"""Trainer-side session routes (admin key)."""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from rollout_proxy.core.responses import ResponsesPlacement, idempotency
from rollout_proxy.core.turn_service import Ask
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys, validation
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response, read_json_object
from rollout_proxy.proxy.schemas import AppendMessages, FinishRequest, SessionCreate
from rollout_proxy.state.store import ReadAhead, RequestBound
from rollout_proxy.wire.feed import FeedImage
from rollout_proxy.wire.images import ImageBlob, count_image_parts
from rollout_proxy.wire.messages import normalize_messages, normalize_tools


def text_messages(messages: list[dict[str, Any]], *, param: str, where: str) -> list[dict[str, Any]]:
    """Messages that hold no image, normalized: the images a turn's request sends are stored with its node,
    and these (``where``) are stored without a turn."""
    normalized = normalize_messages(messages, param=param)
    for index, message in enumerate(normalized):
        if count_image_parts([message]):
            raise InvalidRequest(
                f"images are not taken in {where}: send them in a request of the conversation (a user message)",
                param=f"{param}[{index}].content",
            )
    return normalized


def feed_images(images: dict[str, ImageBlob]) -> dict[str, dict[str, str]]:
    """The finish answer's ``images``: each image the trajectories name, by hash, as a feed entry carries it."""
    return {sha: FeedImage.of(image.data, image.mime).model_dump() for sha, image in images.items()}


async def session_image(request: web.Request) -> web.Response:
    """``GET /v1/sessions/{id}/images/{sha256}``: one image of the session's store, as it was sent."""
    session_id = request.match_info["session_id"]
    request_caller(request).require_session(session_id)
    image = await request.app[keys.SESSIONS].image(session_id, request.match_info["sha256"])
    return web.Response(
        body=image.data,
        content_type=image.mime,
        headers={
            "Cache-Control": "private, max-age=86400, immutable",
            "ETag": f'"{image.sha256}"',
            "X-Content-Type-Options": "nosniff",
        },
    )


def plugin_base_url(request: web.Request) -> str:
    public = request.app[keys.SETTINGS].public_url
    return (public.rstrip("/") if public else f"{request.scheme}://{request.host}") + "/v1"


async def create_session(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(SessionCreate, await read_json_object(request))
    session = await request.app[keys.SESSIONS].create(
        messages=text_messages(body.sample.messages or [], param="sample.messages", where="a session's sample"),
        tools=normalize_tools(body.sample.tools, param="sample.tools"),
        extra=body.sample.extra,
        generation=body.generation.to_config(body.sample.thinking),
        context=body.context,
        n_sample=body.n_sample,
        concurrency=body.concurrency.model_dump() if body.concurrency else None,
        client_sampling=body.client_sampling,
        retry=body.retry,
        policy=body.policy,
    )
    structlog.contextvars.bind_contextvars(session_id=session.id)
    request.app[keys.METRICS].sessions.opened(session.id, session.expires_at)
    return json_response(
        {
            "session_id": session.id,
            "base_url": plugin_base_url(request),
            "api_key": request.app[keys.TOKENS].issue(
                session.id, session.expires_at, bound=RequestBound.of(session.concurrency)
            ),
            "expires_at": int(session.expires_at),
        },
        status=201,
    )


async def get_session(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    caller = request_caller(request)
    caller.require_session(session_id)
    record = (await request.app[keys.SESSIONS].get(session_id)).to_dict()
    if not caller.admin:
        record.pop("engine", None)  # engine URLs are the operator's, not the plugin's
    return json_response(record)


async def append_messages(request: web.Request) -> web.Response:
    """What the SDK's ``update_state_from_messages`` calls: messages the policy did not generate."""
    session_id = request.match_info["session_id"]
    request_caller(request).require_session(session_id)
    body = validation.validate(AppendMessages, await read_json_object(request))
    async with await request.app[keys.SESSIONS].lease_open(session_id, ReadAhead()) as lease:
        messages = text_messages(body.messages, param="messages", where="appended messages")
        claim = idempotency(request.headers.get("Idempotency-Key"), messages, body.previous_response_id)
        node = await request.app[keys.TURNS].append(
            lease,
            Ask(messages),
            ResponsesPlacement(previous_response_id=body.previous_response_id, api="injected"),
            idempotency=claim,
        )
    structlog.contextvars.bind_contextvars(response_id=node.id)
    return json_response({"response_id": node.id, "session_id": session_id}, status=201)


async def finish_session(request: web.Request) -> web.Response:
    """The rollout result: validated, answered with its trajectories, recorded once.

    The answer is serialized before the finish is committed: one that fails leaves the session open."""
    session_id = request.match_info["session_id"]
    request_caller(request).require_session(session_id)
    body = validation.validate(FinishRequest, await read_json_object(request))
    sessions = request.app[keys.SESSIONS]
    plan = await sessions.prepare_finish(
        session_id,
        status=body.status,
        error=body.error,
        extra=body.extra,
        responses=None if body.responses is None else [ref.model_dump() for ref in body.responses],
        config=body.config,
    )
    answer = json_response(
        {
            "session_id": session_id,
            "status": body.status,
            "error": body.error,
            "trajectories": [trajectory.to_json() for trajectory in plan.trajectories],
            **({"images": feed_images(plan.images)} if plan.images else {}),  # a text answer as before
        }
    )
    await sessions.commit_finish(plan)
    request.app[keys.METRICS].sessions.closed(session_id)
    request.app[keys.RESENT_HISTORY].forget(session_id)  # no turn resends its conversation after a finish
    return answer
