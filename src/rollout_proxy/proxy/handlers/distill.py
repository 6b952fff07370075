"""On-policy distillation passes over a recorded trajectory (admin key): the teacher's logprobs, the critic's view.

The core is ``core.distill``. A teacher pass is kept with the session (``GET .../trajectory`` then
carries its fields); the critic's view is only answered.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from rollout_proxy.core.teacher import teacher_fields
from rollout_proxy.proxy import keys, validation
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response, read_json_object


class TeacherPassIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response_id: str
    teacher: str
    teacher_context: list[dict[str, Any]] = Field(default_factory=list)
    topk: int = 0


class CriticViewIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response_id: str
    critic_context: list[dict[str, Any]]


class TeacherPassOut(BaseModel):
    """The teacher's fields for the trajectory (as ``Trajectory`` names them) and the tokens its context added."""

    response_id: str
    teacher: str
    total_teacher_logprobs: list[float | None]
    teacher_topk: dict[str, Any] | None
    n_tokens_injected: int


class CriticViewOut(BaseModel):
    response_id: str
    critic_token_ids: list[int]
    n_tokens_injected: int


async def teacher_pass(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(TeacherPassIn, await read_json_object(request))
    scores = await request.app[keys.DISTILLATION].teacher_pass(
        request.match_info["session_id"],
        body.response_id,
        teacher=body.teacher,
        contexts=body.teacher_context,
        topk=body.topk,
    )
    return json_response(
        {"response_id": body.response_id, **teacher_fields(scores), "n_tokens_injected": scores.n_tokens_injected}
    )


async def critic_view(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(CriticViewIn, await read_json_object(request))
    view, _ = await request.app[keys.DISTILLATION].critic_view(
        request.match_info["session_id"], body.response_id, body.critic_context
    )
    return json_response(
        {
            "response_id": body.response_id,
            "critic_token_ids": view.ids.tolist(),
            "n_tokens_injected": view.n_tokens_injected,
        }
    )
