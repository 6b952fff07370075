"""What a rollout plugin talks to the policy through.

``RolloutInferenceProxy`` is handed to every rollout call: its clients go to the
plugin's own rollout-proxy session (where every token is recorded). For local
debugging, ``InferenceProxy(sample, url=..., jwt_token=..., mode=...)`` builds one of
two subclasses:

- ``LocalInferenceProxy`` (``Mode.Inference``) talks to any OpenAI-compatible endpoint
  directly, applying the sample's generation settings itself and keeping the same
  ``messages`` / ``usage`` / ``finish_reason``;
- ``TrainingInferenceProxy`` (``Mode.Training``) opens a real session on a rollout-proxy
  (``jwt_token`` is then the proxy's admin key) on first need, never in the constructor.

Each proxy object owns one ``ProxyClient`` (no I/O until a request) and closes it, and
the openai clients it made, with ``close()`` / ``aclose()`` or as a context manager.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Self

import jwt
import openai

from rollout_proxy.sdk.clients import (
    wrap_async_client_inplace,
    wrap_client_inplace,
    wrap_responses_async_client_inplace,
    wrap_responses_client_inplace,
)
from rollout_proxy.sdk.transport import ProxyClient, ProxyRequestError, ProxyUnreachable
from rollout_proxy.sdk.types import ChatCompletionSample, Trajectory
from rollout_proxy.wire.messages import normalize_messages
from rollout_proxy.wire.responses import as_dict, assistant_message_of_response, input_to_messages, messages_as_input

__all__ = [
    "InferenceProxy",
    "LocalInferenceProxy",
    "Mode",
    "ProxyRequestError",
    "ProxyUnreachable",
    "RolloutInferenceProxy",
    "TrainingInferenceProxy",
    "session_body",
]

# Where a client of a not-yet-opened training session points until its first create() opens it.
UNOPENED_URL = "http://session-not-open.invalid/v1"
UNOPENED_KEY = "session-not-open"


class Mode(str, enum.Enum):
    Inference = "inference"  # straight to an OpenAI-compatible endpoint, nothing recorded
    Training = "training"  # through a rollout-proxy session, every token recorded


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


def _root(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def _idempotency() -> dict[str, str]:
    """A fresh key per call: a resend of that call (by a transport or a retrying caller) makes one node."""
    return {"Idempotency-Key": str(uuid.uuid4())}


@dataclass(frozen=True)
class SessionEndpoint:
    """Where a session's plugin requests go: its OpenAI base URL and its bearer token."""

    url: str
    token: str

    @property
    def session_id(self) -> str:
        return jwt.decode(self.token, options={"verify_signature": False})["sub"]


class RolloutInferenceProxy:
    """The plugin's handle on its rollout session (``url`` + ``jwt_token``)."""

    mode = Mode.Training

    def __init__(
        self, url: str, jwt_token: str, *, sample: ChatCompletionSample | None = None, group: bool = False
    ) -> None:
        endpoint = SessionEndpoint(url.rstrip("/"), jwt_token)
        self._setup(endpoint, ProxyClient(_root(endpoint.url), jwt_token), sample=sample, group=group)

    def _setup(
        self,
        endpoint: SessionEndpoint | None,
        transport: ProxyClient,
        *,
        sample: ChatCompletionSample | None,
        group: bool,
    ) -> None:
        self._endpoint = endpoint
        self._transport = transport
        self.sample = sample
        self.group = group  # set by @group_rollout: clients then use the Responses API
        self.messages: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._histories: dict[str, list[dict[str, Any]]] = {}
        self._sync_clients: list[openai.OpenAI] = []
        self._async_clients: list[openai.AsyncOpenAI] = []

    # -- the session ------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        """Whether the session exists yet (a rollout session always does)."""
        return self._endpoint is not None

    def open(self) -> None:
        """Make sure the session exists (blocking); a no-op once it does."""

    async def aopen(self) -> None:
        """Make sure the session exists, without blocking the event loop."""

    def _opened(self) -> SessionEndpoint:
        if self._endpoint is None:
            self.open()
        assert self._endpoint is not None
        return self._endpoint

    @property
    def url(self) -> str:
        return self._opened().url

    @property
    def jwt_token(self) -> str:
        return self._opened().token

    @property
    def session_id(self) -> str:
        return self._opened().session_id

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.jwt_token}"}

    # -- what plugins use -------------------------------------------------------------------

    def get_extra_body(self) -> dict[str, Any]:
        """Extra request fields to send with hand-built requests (none: the session pins them)."""
        return {}

    def rollout_client(self) -> openai.OpenAI:
        """A client of this session (chat for single rollouts; group rollouts must use Responses)."""
        self.open()
        client = openai.OpenAI(base_url=UNOPENED_URL, api_key=UNOPENED_KEY)
        self._sync_clients.append(client)
        return wrap_responses_client_inplace(wrap_client_inplace(client, self), self)

    def async_rollout_client(self) -> openai.AsyncOpenAI:
        """The async twin of ``rollout_client`` (a lazy session opens at its first ``create``)."""
        client = openai.AsyncOpenAI(base_url=UNOPENED_URL, api_key=UNOPENED_KEY)
        self._async_clients.append(client)
        return wrap_responses_async_client_inplace(wrap_async_client_inplace(client, self), self)

    def update_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        """Append messages the policy did not generate (weight 0); returns their response id.

        Each call sends its own ``Idempotency-Key``, so a resend of the same call makes one node."""
        self.open()
        sent = [as_dict(m) for m in messages]
        body = {"messages": sent, "previous_response_id": previous_response_id}
        answer = self._transport.request(
            "POST",
            self._session_url("messages"),
            body,
            token=self.jwt_token,
            what="update_state_from_messages",
            headers=_idempotency(),
        )
        return self._remember(answer["response_id"], previous_response_id, sent)

    async def aupdate_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        """``update_state_from_messages`` without blocking the event loop."""
        await self.aopen()
        sent = [as_dict(m) for m in messages]
        body = {"messages": sent, "previous_response_id": previous_response_id}
        answer = await self._transport.arequest(
            "POST",
            self._session_url("messages"),
            body,
            token=self.jwt_token,
            what="update_state_from_messages",
            headers=_idempotency(),
        )
        return self._remember(answer["response_id"], previous_response_id, sent)

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

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sync connections and sync clients (async ones need ``aclose``)."""
        for client in self._sync_clients:
            client.close()
        self._sync_clients.clear()
        self._transport.close()

    async def aclose(self) -> None:
        """Close every connection and client this proxy made."""
        self.close()
        for client in self._async_clients:
            await client.close()
        self._async_clients.clear()
        await self._transport.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- hooks for the client wrappers ------------------------------------------------------

    def _session_url(self, action: str) -> str:
        return f"{_root(self.url)}/v1/sessions/{self.session_id}/{action}"

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
    """Local debugging: ``InferenceProxy(sample, url=..., jwt_token=..., mode=...)`` is a
    ``LocalInferenceProxy`` for ``Mode.Inference``, a ``TrainingInferenceProxy`` for ``Mode.Training``."""

    mode: Mode

    def __new__(
        cls,
        sample: ChatCompletionSample | None = None,
        url: str = "",
        jwt_token: str = "",
        mode: Mode | str = Mode.Inference,
        *,
        group: bool = False,
        n_sample: int | None = None,
        model: str | None = None,
    ) -> InferenceProxy:
        return super().__new__(_BY_MODE[Mode(mode)] if cls is InferenceProxy else cls)

    def __init__(
        self,
        sample: ChatCompletionSample,
        url: str,
        jwt_token: str,
        mode: Mode | str | None = None,
        *,
        group: bool = False,
        n_sample: int | None = None,
        model: str | None = None,
    ) -> None:
        """``model``, when given, replaces the plugin's model name in inference requests
        (plugins often name the production model, which a local endpoint does not serve)."""
        if mode is not None and Mode(mode) is not self.mode:
            raise ValueError(f"{type(self).__name__} runs in {self.mode.value} mode, not {Mode(mode).value}")
        self.model = model  # each mode sets up its own endpoint and transport (``_setup``)
        self.n_sample = n_sample

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Send the rollout result and get the trajectories back (``Mode.Training`` only)."""
        raise RuntimeError(f"finish() needs Mode.Training: {self.mode.value} mode records no trajectories")

    async def afinish(self, result: dict[str, Any]) -> dict[str, Any]:
        """``finish`` without blocking the event loop."""
        return self.finish(result)


class LocalInferenceProxy(InferenceProxy):
    """``Mode.Inference``: straight to an OpenAI-compatible endpoint; nothing recorded but here."""

    mode = Mode.Inference

    def __init__(
        self,
        sample: ChatCompletionSample,
        url: str,
        jwt_token: str,
        mode: Mode | str | None = None,
        *,
        group: bool = False,
        n_sample: int | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(sample, url, jwt_token, mode, group=group, n_sample=n_sample, model=model)
        endpoint = SessionEndpoint(url.rstrip("/"), jwt_token)
        self._setup(endpoint, ProxyClient(_root(endpoint.url), jwt_token), sample=sample, group=group)

    def update_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        local_id = f"local_{len(self._histories)}"
        return self._remember(local_id, previous_response_id, [as_dict(m) for m in messages])

    async def aupdate_state_from_messages(self, messages: list[Any], previous_response_id: str | None = None) -> str:
        return self.update_state_from_messages(messages, previous_response_id)  # no I/O: kept here

    def get_extra_body(self) -> dict[str, Any]:
        if self.sample is None or self.sample.top_k <= 0:
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
        return {**kwargs, **self._generation("max_tokens")}

    def _responses_request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Inference endpoints may keep no responses: replay the conversation instead."""
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
        data = as_dict(response)
        history = normalize_messages(input_to_messages(kwargs["input"]))
        self._histories[data["id"]] = self.messages = [*history, assistant_message_of_response(data)]
        self.usage = data.get("usage")
        self.finish_reason = "length" if data.get("status") == "incomplete" else "stop"


class TrainingInferenceProxy(InferenceProxy):
    """``Mode.Training``: a real session on a rollout-proxy (``url`` its root, ``jwt_token`` its admin key).

    The session is opened on first need, not in the constructor: by the first sync call
    that needs it (``rollout_client()``, ``update_state_from_messages``, ``finish``, reading
    ``url`` / ``jwt_token`` / ``session_id``) or, without blocking, by ``await aopen()`` and
    the async methods (an async client's first ``create``, ``aupdate_state_from_messages``,
    ``afinish``). Concurrent first calls open one session.
    """

    mode = Mode.Training

    def __init__(
        self,
        sample: ChatCompletionSample,
        url: str,
        jwt_token: str,
        mode: Mode | str | None = None,
        *,
        group: bool = False,
        n_sample: int | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(sample, url, jwt_token, mode, group=group, n_sample=n_sample, model=model)
        self.admin_url, self.admin_key = _root(url), jwt_token
        self._setup(None, ProxyClient(self.admin_url, jwt_token), sample=sample, group=group)
        self._opening = threading.Lock()
        self._aopening = asyncio.Lock()

    def _session_request(self) -> dict[str, Any]:
        assert self.sample is not None
        return session_body(self.sample, n_sample=self.n_sample if self.group else None)

    def _open_with(self, created: dict[str, Any]) -> None:
        self._endpoint = SessionEndpoint(created["base_url"].rstrip("/"), created["api_key"])

    def open(self) -> None:
        with self._opening:
            if self._endpoint is None:
                self._open_with(
                    self._transport.post("/v1/sessions", self._session_request(), what="creating a session")
                )

    async def aopen(self) -> None:
        async with self._aopening:
            if self._endpoint is None:
                body = self._session_request()
                self._open_with(await self._transport.apost("/v1/sessions", body, what="creating a session"))

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """Send the rollout result (with the admin key); the proxy's answer holds the trajectories."""
        return self._transport.post(f"/v1/sessions/{self.session_id}/finish", result, what="finish")

    async def afinish(self, result: dict[str, Any]) -> dict[str, Any]:
        """``finish`` without blocking the event loop."""
        await self.aopen()
        return await self._transport.apost(f"/v1/sessions/{self.session_id}/finish", result, what="finish")


_BY_MODE: dict[Mode, type[InferenceProxy]] = {
    Mode.Inference: LocalInferenceProxy,
    Mode.Training: TrainingInferenceProxy,
}
