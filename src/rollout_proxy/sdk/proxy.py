"""What a rollout plugin talks to the policy through.

``RolloutInferenceProxy`` is handed to every rollout call: its clients go to the
plugin's own rollout-proxy session (where every token is recorded). For local
debugging, ``InferenceProxy(sample, url=..., jwt_token=..., mode=Mode.Inference)``
talks to any OpenAI-compatible endpoint directly, applying the sample's generation
settings itself and keeping the same ``messages`` / ``usage`` / ``finish_reason``;
``Mode.Training`` opens a real session on a rollout-proxy (``jwt_token`` is then the
proxy's admin key).
"""

from __future__ import annotations

import copy
import enum
import json
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import jwt
import openai

from rollout_proxy.sdk.clients import (
    wrap_async_client_inplace,
    wrap_client_inplace,
    wrap_responses_async_client_inplace,
    wrap_responses_client_inplace,
)
from rollout_proxy.sdk.types import ChatCompletionSample, Trajectory
from rollout_proxy.wire.messages import normalize_messages
from rollout_proxy.wire.responses import as_dict, assistant_message_of_response, input_to_messages, messages_as_input


class Mode(str, enum.Enum):
    Inference = "inference"  # straight to an OpenAI-compatible endpoint, nothing recorded
    Training = "training"  # through a rollout-proxy session, every token recorded


class ProxyRequestError(RuntimeError):
    """The rollout-proxy refused a state update; the message is the proxy's."""


def post_json(url: str, body: dict[str, Any], token: str, *, what: str) -> dict[str, Any]:
    """A blocking JSON POST to the proxy; its error body becomes a ProxyRequestError."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise ProxyRequestError(f"{what} failed ({exc.code}): {exc.read().decode()}") from None


def session_body(sample: ChatCompletionSample, *, n_sample: int | None = None, **fields: Any) -> dict[str, Any]:
    """The ``POST /v1/sessions`` body for a sample (its GenerationConfig pinned)."""
    body: dict[str, Any] = {
        "sample": {
            "messages": sample.message_dicts(),
            "tools": sample.tools,
            "extra": sample.extra or {},
            "thinking": sample.thinking.model_dump() if sample.thinking else None,
        },
        "generation": sample.generation(),
        **fields,
    }
    if n_sample is not None:
        body["n_sample"] = n_sample
    return body


class RolloutInferenceProxy:
    """The plugin's handle on its rollout session (``url`` + ``jwt_token``)."""

    mode = Mode.Training

    def __init__(
        self, url: str, jwt_token: str, *, sample: ChatCompletionSample | None = None, group: bool = False
    ) -> None:
        self.url = url.rstrip("/")
        self.jwt_token = jwt_token
        self.sample = sample
        self.group = group  # set by @group_rollout: clients then use the Responses API
        self.messages: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._histories: dict[str, list[dict[str, Any]]] = {}

    # -- what plugins use -------------------------------------------------------------------

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.jwt_token}"}

    @property
    def session_id(self) -> str:
        claims = jwt.decode(self.jwt_token, options={"verify_signature": False})
        return claims["sub"]

    def get_extra_body(self) -> dict[str, Any]:
        """Extra request fields to send with hand-built requests (none: the session pins them)."""
        return {}

    def rollout_client(self) -> openai.OpenAI:
        """A client of this session (chat for single rollouts; group rollouts must use Responses)."""
        client = openai.OpenAI(base_url=self.url, api_key=self.jwt_token)
        return wrap_responses_client_inplace(wrap_client_inplace(client, self), self)

    def async_rollout_client(self) -> openai.AsyncOpenAI:
        """The async twin of ``rollout_client``."""
        client = openai.AsyncOpenAI(base_url=self.url, api_key=self.jwt_token)
        return wrap_responses_async_client_inplace(wrap_async_client_inplace(client, self), self)

    def update_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        """Append messages the policy did not generate (weight 0); returns their response id."""
        body = {"messages": [as_dict(m) for m in messages], "previous_response_id": previous_response_id}
        answer = post_json(self._session_url("messages"), body, self.jwt_token, what="update_state_from_messages")
        return self._remember(answer["response_id"], previous_response_id, body["messages"])

    async def aupdate_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        """``update_state_from_messages`` without blocking the event loop."""
        body = {"messages": [as_dict(m) for m in messages], "previous_response_id": previous_response_id}
        async with (
            aiohttp.ClientSession() as http,
            http.post(self._session_url("messages"), json=body, headers=self.headers) as answer,
        ):
            payload = await answer.json(content_type=None)
            if answer.status >= 400:
                raise ProxyRequestError(f"update_state_from_messages failed ({answer.status}): {payload}")
        return self._remember(payload["response_id"], previous_response_id, body["messages"])

    def process_completion(self, completion: Any, messages: list[Any] | None = None) -> None:
        """Record a chat completion: the conversation it ends, its usage and finish reason."""
        data = as_dict(completion)
        choice = data["choices"][0]
        history = [as_dict(m) for m in messages] if messages is not None else list(self.messages)
        message = {key: value for key, value in choice["message"].items() if value is not None}
        self.messages = [*history, message]
        self.usage = data.get("usage")
        self.finish_reason = choice.get("finish_reason")
        if data.get("id"):
            self._histories[data["id"]] = self.messages

    def trajectory(self, extra: dict[str, Any] | None = None) -> Trajectory:
        """What a grader sees of the latest call (tokens come from the proxy in training)."""
        return Trajectory(messages=self.messages, usage=self.usage, finish_reason=self.finish_reason, extra=extra or {})

    # -- hooks for the client wrappers ------------------------------------------------------

    def _session_url(self, action: str) -> str:
        root = self.url.removesuffix("/v1")
        return f"{root}/v1/sessions/{self.session_id}/{action}"

    def _root_history(self) -> list[dict[str, Any]]:
        return self.sample.message_dicts() if self.sample is not None else []

    def _remember(self, response_id: str, previous_response_id: str | None, messages: list[dict[str, Any]]) -> str:
        base = self._histories.get(previous_response_id, []) if previous_response_id else self._root_history()
        self._histories[response_id] = self.messages = [*base, *messages]
        return response_id

    def _chat_request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs

    def _responses_request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs

    def _record_response(self, kwargs: dict[str, Any], response: Any) -> None:
        data = as_dict(response)
        previous = kwargs.get("previous_response_id")
        base = self._histories.get(previous, []) if previous else self._root_history()
        new_input = normalize_messages(input_to_messages(kwargs.get("input")))
        self._histories[data["id"]] = self.messages = [*base, *new_input, assistant_message_of_response(data)]
        self.usage = data.get("usage")
        self.finish_reason = "length" if data.get("status") == "incomplete" else data.get("finish_reason") or "stop"


class InferenceProxy(RolloutInferenceProxy):
    """Local debugging: ``Mode.Inference`` against any OpenAI-compatible endpoint, or
    ``Mode.Training`` through a rollout-proxy (``url`` its root, ``jwt_token`` its admin key)."""

    def __init__(
        self,
        sample: ChatCompletionSample,
        url: str,
        jwt_token: str,
        mode: Mode = Mode.Inference,
        *,
        group: bool = False,
        n_sample: int | None = None,
        model: str | None = None,
    ) -> None:
        """``model``, when given, replaces the plugin's model name in inference requests
        (plugins often name the production model, which a local endpoint does not serve)."""
        self.mode = Mode(mode)
        self.model = model
        if self.mode is Mode.Training:
            root = url.rstrip("/").removesuffix("/v1")
            body = session_body(sample, n_sample=n_sample if group else None)
            session = post_json(f"{root}/v1/sessions", body, jwt_token, what="creating a session")
            super().__init__(session["base_url"], session["api_key"], sample=sample, group=group)
            self.admin_url, self.admin_key = url.rstrip("/").removesuffix("/v1"), jwt_token
        else:
            super().__init__(url, jwt_token, sample=sample, group=group)

    def update_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        if self.mode is Mode.Training:
            return super().update_state_from_messages(messages, previous_response_id)
        local_id = f"local_{len(self._histories)}"
        return self._remember(local_id, previous_response_id, [as_dict(m) for m in messages])

    async def aupdate_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        if self.mode is Mode.Training:
            return await super().aupdate_state_from_messages(messages, previous_response_id)
        return self.update_state_from_messages(messages, previous_response_id)

    def get_extra_body(self) -> dict[str, Any]:
        if self.mode is Mode.Training or self.sample is None or self.sample.top_k <= 0:
            return {}
        return {"top_k": self.sample.top_k}

    def _generation(self, max_tokens_name: str) -> dict[str, Any]:
        settings: dict[str, Any] = {"model": self.model} if self.model else {}
        sample = self.sample
        if sample is None:
            return settings
        settings.update(
            {"temperature": sample.temperature, "top_p": sample.top_p, max_tokens_name: sample.max_new_tokens}
        )
        if self.get_extra_body():
            settings["extra_body"] = self.get_extra_body()
        return settings

    def _chat_request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.mode is Mode.Training:
            return kwargs
        return {**kwargs, **self._generation("max_tokens")}

    def _responses_request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Inference endpoints may keep no responses: replay the conversation instead."""
        if self.mode is Mode.Training:
            return kwargs
        previous = kwargs.get("previous_response_id")
        history = self._histories.get(previous, []) if previous else self._root_history()
        new_input = normalize_messages(input_to_messages(kwargs.get("input")))
        sent = {key: value for key, value in kwargs.items() if key != "previous_response_id"}
        sent["input"] = messages_as_input(copy.deepcopy([*history, *new_input]))
        sent["store"] = False
        generation = self._generation("max_output_tokens")
        generation.pop("extra_body", None)
        return {**sent, **generation}

    def _record_response(self, kwargs: dict[str, Any], response: Any) -> None:
        if self.mode is Mode.Training:
            return super()._record_response(kwargs, response)
        data = as_dict(response)
        history = normalize_messages(input_to_messages(kwargs["input"]))
        self._histories[data["id"]] = self.messages = [*history, assistant_message_of_response(data)]
        self.usage = data.get("usage")
        self.finish_reason = "length" if data.get("status") == "incomplete" else "stop"

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Training mode: send the rollout result, get the trajectories back."""
        if self.mode is not Mode.Training:
            raise RuntimeError("finish() needs Mode.Training: an inference endpoint records no trajectories")
        url = f"{self.admin_url}/v1/sessions/{self.session_id}/finish"
        return post_json(url, result, self.admin_key, what="finish")
