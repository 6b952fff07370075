"""Point an ``openai`` client at a rollout session, and keep the session's view of it.

The wrappers replace ``chat.completions.create`` / ``responses.create`` on one client
instance: they refuse GenerationConfig parameters before anything is sent (the
session pins them), open a lazily-created session if it is not open yet (an async
client's without blocking the event loop) and point the client at it, and record
each answer on the proxy (``messages``, ``usage``, ``finish_reason``) so a grader can
be fed without another request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import openai

from rollout_proxy.wire.generation import PINNED_GENERATION_PARAMETERS

if TYPE_CHECKING:
    from rollout_proxy.sdk.proxy import RolloutInferenceProxy


class GenerationParameterError(ValueError):
    """A plugin set a generation parameter that the sample or the job pins."""


class RolloutApiError(RuntimeError):
    """A plugin used an API its rollout kind does not allow."""


def refuse_generation_parameters(kwargs: dict[str, Any]) -> None:
    extra_body = kwargs.get("extra_body") or {}
    for name in PINNED_GENERATION_PARAMETERS:
        for source, where in ((kwargs, "create()"), (extra_body, "extra_body")):
            value = source.get(name)
            if value is not None and value is not openai.NOT_GIVEN and not isinstance(value, openai.NotGiven):
                raise GenerationParameterError(
                    f"do not set {name!r} in {where}: n, max_new_tokens, top_p, top_k, temperature and thinking "
                    "are GenerationConfig, set in the sample or the job's hyperparameters"
                )


@dataclass(frozen=True)
class _Api:
    """One wrapped API: ``check`` refuses a call before any I/O, ``request`` turns the
    plugin's arguments into what is sent, ``record`` keeps the answer on the proxy."""

    check: Callable[[dict[str, Any]], None]
    request: Callable[[dict[str, Any]], dict[str, Any]]
    record: Callable[[dict[str, Any], Any], None]


def _chat(proxy: RolloutInferenceProxy) -> _Api:
    def check(kwargs: dict[str, Any]) -> None:
        if proxy.group:
            raise RolloutApiError("a group rollout must use the Responses API (client.responses.create), not chat")
        refuse_generation_parameters(kwargs)

    def record(sent: dict[str, Any], completion: Any) -> None:
        proxy.process_completion(completion, messages=sent.get("messages"))

    return _Api(check, proxy._chat_request, record)


def _responses(proxy: RolloutInferenceProxy) -> _Api:
    return _Api(refuse_generation_parameters, proxy._responses_request, proxy._record_response)


def _point_at(client: openai.OpenAI | openai.AsyncOpenAI, proxy: RolloutInferenceProxy) -> None:
    """Aim the client at the session, once it exists (reading ``proxy.url`` never opens one here)."""
    if proxy.is_open:
        client.base_url = proxy.url
        client.api_key = proxy.jwt_token


def _wrap_sync(resource: Any, client: openai.OpenAI, proxy: RolloutInferenceProxy, api: _Api) -> None:
    original = resource.create

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        api.check(kwargs)
        proxy.open()
        _point_at(client, proxy)
        sent = api.request(kwargs)
        answer = original(*args, **sent)
        api.record(sent, answer)
        return answer

    resource.create = create
    _point_at(client, proxy)


def _wrap_async(resource: Any, client: openai.AsyncOpenAI, proxy: RolloutInferenceProxy, api: _Api) -> None:
    original = resource.create

    @functools.wraps(original)
    async def create(*args: Any, **kwargs: Any) -> Any:
        api.check(kwargs)
        await proxy.aopen()
        _point_at(client, proxy)
        sent = api.request(kwargs)
        answer = await original(*args, **sent)
        api.record(sent, answer)
        return answer

    resource.create = create
    _point_at(client, proxy)


def wrap_client_inplace(client: openai.OpenAI, proxy: RolloutInferenceProxy) -> openai.OpenAI:
    """Chat Completions of a sync client, for a single rollout."""
    _wrap_sync(client.chat.completions, client, proxy, _chat(proxy))
    return client


def wrap_async_client_inplace(client: openai.AsyncOpenAI, proxy: RolloutInferenceProxy) -> openai.AsyncOpenAI:
    """Chat Completions of an async client, for a single rollout."""
    _wrap_async(client.chat.completions, client, proxy, _chat(proxy))
    return client


def wrap_responses_client_inplace(client: openai.OpenAI, proxy: RolloutInferenceProxy) -> openai.OpenAI:
    """The Responses API of a sync client (group rollouts must use it)."""
    _wrap_sync(client.responses, client, proxy, _responses(proxy))
    return client


def wrap_responses_async_client_inplace(client: openai.AsyncOpenAI, proxy: RolloutInferenceProxy) -> openai.AsyncOpenAI:
    """The Responses API of an async client (group rollouts must use it)."""
    _wrap_async(client.responses, client, proxy, _responses(proxy))
    return client
