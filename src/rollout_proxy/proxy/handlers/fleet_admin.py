"""Fleet operations (admin key): the engines and their states, adding and draining engines,
pausing and resuming them around a weight update. The core is ``engines.fleet`` and
``engines.control``; these only parse and answer."""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_proxy.engines import control
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys, validation
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response, read_json_object
from rollout_proxy.settings import check_engine_url

#: Policy versions are the trainer's integer steps; JSON's safe integers (what every client reads exactly).
MAX_POLICY_VERSION = 2**53 - 1
MAX_URL_CHARS = 2048


class EngineIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(min_length=1, max_length=MAX_URL_CHARS, description="the engine's base URL")
    #: the weights the operator loaded into it (re-admits a stale engine when it is the fleet's version)
    policy_version: int | None = Field(None, ge=0, le=MAX_POLICY_VERSION)

    @field_validator("url")
    @classmethod
    def _engine_url(cls, url: str) -> str:
        return check_engine_url(url)


class PauseIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    #: abort: calls in flight end now and are finished after the resume (--abort-policy); wait: the
    #: pause answers once they are done; keep: they freeze and go on after the resume
    mode: Literal["abort", "wait", "keep"] = "abort"


class ResumeIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    #: the trainer's step whose weights the paused engines now hold
    policy_version: int = Field(ge=0, le=MAX_POLICY_VERSION)


async def list_engines(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    return json_response(request.app[keys.ENGINES].view())


async def add_engine(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(EngineIn, await read_json_object(request))
    return json_response(await request.app[keys.ENGINES].admit(body.url, policy_version=body.policy_version))


async def remove_engine(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    url = request.query.get("url")
    if not url:
        raise InvalidRequest("name the engine to remove: ?url=<its base URL>", param="url")
    return json_response(await request.app[keys.ENGINES].remove(url))


async def pause(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(PauseIn, await read_json_object(request))
    return json_response(await control.pause(request.app[keys.ENGINES], body.mode))


async def resume(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(ResumeIn, await read_json_object(request))
    return json_response(await control.resume(request.app[keys.ENGINES], body.policy_version))
