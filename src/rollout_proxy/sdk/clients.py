"""Point an ``openai`` client at a rollout session, and keep the session's view of it.

The wrappers replace ``chat.completions.create`` / ``responses.create`` on one client
instance: they refuse GenerationConfig parameters before anything is sent (the
session pins them), and record each answer on the proxy (``messages``, ``usage``,
``finish_reason``) so a grader can be fed without another request.
"""

from __future__ import annotations

import functools
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


def _point_at(client: openai.OpenAI | openai.AsyncOpenAI, proxy: RolloutInferenceProxy) -> None:
    client.base_url = proxy.url
    client.api_key = proxy.jwt_token


def _wrap(resource: Any, before, after, *, is_async: bool) -> None:
    original = resource.create
    if is_async:

        @functools.wraps(original)
        async def create(*args: Any, **kwargs: Any) -> Any:
            sent = before(kwargs)
            return after(sent, await original(*args, **sent))

    else:

        @functools.wraps(original)
        def create(*args: Any, **kwargs: Any) -> Any:
            sent = before(kwargs)
            return after(sent, original(*args, **sent))

    resource.create = create


def _chat_hooks(proxy: RolloutInferenceProxy):
    def before(kwargs: dict[str, Any]) -> dict[str, Any]:
        if proxy.group:
            raise RolloutApiError("a group rollout must use the Responses API (client.responses.create), not chat")
        refuse_generation_parameters(kwargs)
        return proxy._chat_request(kwargs)

    def after(kwargs: dict[str, Any], completion: Any) -> Any:
        proxy.process_completion(completion, messages=kwargs.get("messages"))
        return completion

    return before, after


def _responses_hooks(proxy: RolloutInferenceProxy):
    def before(kwargs: dict[str, Any]) -> dict[str, Any]:
        refuse_generation_parameters(kwargs)
        return proxy._responses_request(kwargs)

    def after(kwargs: dict[str, Any], response: Any) -> Any:
        proxy._record_response(kwargs, response)
        return response

    return before, after


def wrap_client_inplace(client: openai.OpenAI, proxy: RolloutInferenceProxy) -> openai.OpenAI:
    """Chat Completions of a sync client, for a single rollout."""
    _point_at(client, proxy)
    _wrap(client.chat.completions, *_chat_hooks(proxy), is_async=False)
    return client


def wrap_async_client_inplace(client: openai.AsyncOpenAI, proxy: RolloutInferenceProxy) -> openai.AsyncOpenAI:
    """Chat Completions of an async client, for a single rollout."""
    _point_at(client, proxy)
    _wrap(client.chat.completions, *_chat_hooks(proxy), is_async=True)
    return client


def wrap_responses_client_inplace(client: openai.OpenAI, proxy: RolloutInferenceProxy) -> openai.OpenAI:
    """The Responses API of a sync client (group rollouts must use it)."""
    _point_at(client, proxy)
    _wrap(client.responses, *_responses_hooks(proxy), is_async=False)
    return client


def wrap_responses_async_client_inplace(client: openai.AsyncOpenAI, proxy: RolloutInferenceProxy) -> openai.AsyncOpenAI:
    """The Responses API of an async client (group rollouts must use it)."""
    _point_at(client, proxy)
    _wrap(client.responses, *_responses_hooks(proxy), is_async=True)
    return client
