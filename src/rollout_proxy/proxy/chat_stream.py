"""A streamed chat turn as ``chat.completion.chunk`` events, as the openai SDK consumes them.

Every chunk has the response id (the non-streamed answer's ``id``). The first has
``delta: {"role": "assistant", "content": ""}`` and the extension ``prompt_token_ids``; each
engine step's chunk has the extension ``token_ids`` (concatenated, the turn's ``token_ids``)
and, with ``logprobs: true``, their logprobs; deltas carry ``content``, ``reasoning_content``
(and ``reasoning``, as the non-streamed message), and ``tool_calls`` once a call parsed: its
index, id, type and function name, then its arguments in the next chunk. The last chunk has
the ``finish_reason`` (with ``"usage"``'s numbers in a ``choices: []`` chunk when
``stream_options.include_usage``), then ``data: [DONE]``. A failure after the first chunk: ``event: error`` with an OpenAI error
body, which the SDK raises as ``APIError``.
"""

from __future__ import annotations

from typing import Any

from rollout_proxy.core.streaming import StreamEvent, TurnDelta, TurnDone, TurnStarted
from rollout_proxy.errors import InvalidRequest, ProxyError
from rollout_proxy.proxy.sse import Frame


def include_usage(extra: dict[str, Any] | None) -> bool:
    """``stream_options.include_usage`` (an unknown option is ignored, a wrong type refused)."""
    options = (extra or {}).get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequest("stream_options must be an object with a boolean include_usage", param="stream_options")
    return bool(options.get("include_usage"))


class ChatChunks:
    def __init__(self, started: TurnStarted, *, model: str | None, usage: bool, logprobs: bool) -> None:
        self._id = started.response_id
        self._model = model or started.model
        self._created = int(started.created)
        self._usage = usage
        self._logprobs = logprobs
        self._calls = 0

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> Frame:
        body = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "system_fingerprint": None,
            "choices": [choice] if choice else [],
            **extra,
        }
        return None, body

    def start(self, started: TurnStarted) -> list[Frame]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._chunk(choice, prompt_token_ids=started.prompt_ids)]

    def frames(self, event: StreamEvent) -> list[Frame]:
        if isinstance(event, TurnDelta):
            first = self._calls
            frames = [self._chunk(self._delta(event))]
            for offset, call in enumerate(event.view.tool_calls):  # then each call's arguments, as OpenAI sends them
                piece = {"index": first + offset, "function": {"arguments": call["function"]["arguments"]}}
                choice = {"index": 0, "delta": {"tool_calls": [piece]}, "logprobs": None, "finish_reason": None}
                frames.append(self._chunk({**choice, "token_ids": []}))
            return frames
        if isinstance(event, TurnDone):
            node = event.result.node
            last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": node.finish_reason, "token_ids": []}
            frames = [self._chunk(last)]
            if self._usage:
                frames.append(self._chunk({}, usage=node.usage))
            return [*frames, (None, "[DONE]")]
        return []

    def _delta(self, event: TurnDelta) -> dict[str, Any]:
        view = event.view
        delta: dict[str, Any] = {}
        if view.reasoning:
            delta["reasoning_content"] = view.reasoning
            delta["reasoning"] = view.reasoning
        if view.content:
            delta["content"] = view.content
        if view.tool_calls:  # the header: id, type, name (the arguments follow in their own chunk)
            delta["tool_calls"] = [
                {
                    "index": self._calls + offset,
                    "id": call["id"],
                    "type": call["type"],
                    "function": {"name": call["function"]["name"], "arguments": ""},
                }
                for offset, call in enumerate(view.tool_calls)
            ]
            self._calls += len(view.tool_calls)
        logprobs: dict[str, Any] | None = None
        if self._logprobs and len(event.token_ids):
            logprobs = {
                "content": [
                    {"token": f"token_id:{token}", "logprob": float(value), "bytes": None, "top_logprobs": []}
                    for token, value in zip(event.token_ids.tolist(), event.logprobs.tolist(), strict=True)
                ]
            }
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None, "token_ids": event.token_ids}

    def error(self, error: ProxyError) -> list[Frame]:
        return [("error", error.to_body())]
