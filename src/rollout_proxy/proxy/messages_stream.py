"""A streamed Messages turn as Anthropic's event sequence, as the anthropic SDKs and Claude Code consume it
(each frame ``event: <type>`` with the same ``type`` in its data):

``message_start`` (the message with empty ``content``, ``usage.input_tokens`` and the extension
``prompt_token_ids``), ``ping``; then, block by block as the engine samples: ``content_block_start``,
``content_block_delta`` (``thinking_delta``, then the block's ``signature_delta``; ``text_delta``; a tool
call's ``input_json_delta`` with its whole arguments once the call parsed), ``content_block_stop``; then
``message_delta`` (``stop_reason``, ``usage.output_tokens``, the extension ``token_ids``: everything the
policy sampled) and ``message_stop``. The blocks are those of the non-streamed message (thinking, text,
tool calls, in the order the policy produced them). A failure after the first event: an ``error`` event
(``{"type": "error", "error": {"type", "message"}}``), which the SDKs raise.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_proxy.core.streaming import StreamEvent, TurnDelta, TurnDone, TurnStarted
from rollout_proxy.errors import ProxyError
from rollout_proxy.proxy.anthropic_answers import error_body, sign, stop_reason, stop_sequence, tool_input, usage
from rollout_proxy.proxy.sse import Frame


class MessageEvents:
    def __init__(self, started: TurnStarted, *, model: str | None, key: bytes) -> None:
        self._id = started.response_id
        self._model = model or started.model
        self._key = key
        self._prompt_tokens = len(started.prompt_ids)
        self._index = -1  # the open block's index
        self._open: str | None = None  # its type
        self._thinking: list[str] = []  # the open thinking block's text so far, in pieces

    @staticmethod
    def _event(kind: str, **fields: Any) -> Frame:
        return kind, {"type": kind, **fields}

    def start(self, started: TurnStarted) -> list[Frame]:
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self._prompt_tokens, 0),
            "prompt_token_ids": started.prompt_ids,
        }
        return [self._event("message_start", message=message), self._event("ping")]

    def frames(self, event: StreamEvent) -> list[Frame]:
        if isinstance(event, TurnDelta):
            frames: list[Frame] = []
            view = event.view
            if view.reasoning:
                frames += self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self._thinking.append(view.reasoning)
                frames.append(self._delta({"type": "thinking_delta", "thinking": view.reasoning}))
            if view.content:
                frames += self._open_block("text", {"type": "text", "text": ""})
                frames.append(self._delta({"type": "text_delta", "text": view.content}))
            for call in view.tool_calls:  # each parsed call whole: its block, its arguments, its end
                function = call["function"]
                block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
                frames += self._open_block("tool_use", block, always=True)
                arguments = tool_input(function["arguments"])
                frames.append(
                    self._delta({"type": "input_json_delta", "partial_json": orjson.dumps(arguments).decode()})
                )
            return frames
        if isinstance(event, TurnDone):
            node = event.result.node
            delta = {"stop_reason": stop_reason(node), "stop_sequence": stop_sequence(node)}
            return [
                *self._close_block(),
                self._event(
                    "message_delta",
                    delta=delta,
                    usage=usage(self._prompt_tokens, len(node.output_ids)),
                    token_ids=node.output_ids,
                ),
                self._event("message_stop"),
            ]
        return []

    def _delta(self, delta: dict[str, Any]) -> Frame:
        return self._event("content_block_delta", index=self._index, delta=delta)

    def _open_block(self, kind: str, block: dict[str, Any], *, always: bool = False) -> list[Frame]:
        """Start a block of ``kind`` unless one is open (a tool call's block is always a new one)."""
        if self._open == kind and not always:
            return []
        frames = self._close_block()
        self._index += 1
        self._open = kind
        return [*frames, self._event("content_block_start", index=self._index, content_block=block)]

    def _close_block(self) -> list[Frame]:
        if self._open is None:
            return []
        frames: list[Frame] = []
        if self._open == "thinking":
            signature = sign(self._key, self._id, "".join(self._thinking))
            frames.append(self._delta({"type": "signature_delta", "signature": signature}))
            self._thinking = []
        self._open = None
        return [*frames, self._event("content_block_stop", index=self._index)]

    def error(self, error: ProxyError) -> list[Frame]:
        return [("error", error_body(error))]
