"""LoRA policies (admin key): list them, register one, publish its next version, retire one. The core is
``engines.policies``; these only parse and answer."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from rollout_proxy.proxy import keys, validation
from rollout_proxy.proxy.handlers.common import request_caller
from rollout_proxy.proxy.http import json_response, read_json_object

MAX_PATH_CHARS = 4096


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    #: 1-64 letters, digits, '.', '_' or '-'; not "base" (the base model's policy)
    name: str = Field(min_length=1, max_length=64)
    #: an adapter directory to publish as version 1 at once (absolute, as the engines read it)
    path: str | None = Field(None, min_length=1, max_length=MAX_PATH_CHARS)


class VersionIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    #: the adapter's directory (adapter_config.json and its weights), absolute, as the engines read it
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)


async def list_policies(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    return json_response(await request.app[keys.POLICIES].view())


async def get_policy(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    return json_response(await request.app[keys.POLICIES].view_one(request.match_info["name"]))


async def register_policy(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(PolicyIn, await read_json_object(request))
    return json_response(await request.app[keys.POLICIES].register(body.name, path=body.path))


async def publish_version(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    body = validation.validate(VersionIn, await read_json_object(request))
    return json_response(await request.app[keys.POLICIES].publish(request.match_info["name"], body.path))


async def retire_policy(request: web.Request) -> web.Response:
    request_caller(request, admin_only=True)
    return json_response(await request.app[keys.POLICIES].retire(request.match_info["name"]))
