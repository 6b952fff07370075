"""A streamed Responses turn as the event sequence ``client.responses.create(stream=True)`` and
``client.responses.stream(...)`` consume (each event with its ``sequence_number``):

``response.created``, ``response.in_progress``; for reasoning: ``response.output_item.added``
(``reasoning``), ``response.reasoning_text.delta``… ``.done``, ``response.output_item.done``;
for text: ``response.output_item.added`` (``message``), ``response.content_part.added``,
``response.output_text.delta``… ``.done``, ``response.content_part.done``,
``response.output_item.done``; for each function call, once the turn ended (a call is sent
whole once it parsed, and the stored output lists calls after the message):
``response.output_item.added``, ``response.function_call_arguments.delta`` / ``.done``,
``response.output_item.done``; then ``response.completed`` with the response as
``GET /v1/responses/{id}`` returns it (usage, ``token_ids``, ``prompt_token_ids``). Item ids
are the stored ones (``openai_responses.output_items``). A failure after the first event:
``error`` (``{"type": "error", "code", "message", "param", "sequence_number"}``).
"""

from __future__ import annotations

from typing import Any

from rollout_proxy.core.streaming import StreamEvent, TurnDelta, TurnDone, TurnStarted
from rollout_proxy.errors import ProxyError
from rollout_proxy.proxy.openai_responses import flat_tools, output_items, response_body
from rollout_proxy.proxy.sse import Frame
from rollout_proxy.records import SessionRecord


class ResponseEvents:
    def __init__(
        self, started: TurnStarted, *, session: SessionRecord, tools: list[dict[str, Any]] | None, model: str | None
    ) -> None:
        self._started = started
        self._session = session
        self._tools = tools
        self._model = model
        self._suffix = started.response_id.removeprefix("resp_")
        self._sequence = 0
        self._next_index = 0
        # (output index, the text so far in pieces: a long turn is not copied at every delta) once open
        self._reasoning: tuple[int, list[str]] | None = None
        self._message: tuple[int, list[str]] | None = None
        self._reasoning_done = False

    def _event(self, kind: str, **fields: Any) -> Frame:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return kind, body

    def _skeleton(self) -> dict[str, Any]:
        started, generation = self._started, self._session.generation
        return {
            "id": started.response_id,
            "object": "response",
            "created_at": int(started.created),
            "model": self._model or started.model,
            "status": "in_progress",
            "incomplete_details": None,
            "error": None,
            "instructions": started.meta.get("instructions"),
            "previous_response_id": started.meta.get("previous_response_id"),
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": started.meta.get("tool_choice", "auto"),
            "tools": flat_tools(self._tools),
            "temperature": generation.temperature,
            "top_p": generation.top_p,
            "max_output_tokens": generation.max_new_tokens,
            "store": started.meta.get("store", True),
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": {},
            "usage": None,
        }

    def start(self, started: TurnStarted) -> list[Frame]:
        skeleton = self._skeleton()
        return [
            self._event("response.created", response=skeleton),
            self._event("response.in_progress", response=skeleton),
        ]

    def frames(self, event: StreamEvent) -> list[Frame]:
        if isinstance(event, TurnDelta):
            frames: list[Frame] = []
            if event.view.reasoning:
                frames += self._reasoning_delta(event.view.reasoning)
            if event.view.content:
                frames += self._close_reasoning()
                frames += self._text_delta(event.view.content)
            return frames  # tool calls wait for the end (see the module docstring)
        if isinstance(event, TurnDone):
            return self._done(event)
        return []

    def _reasoning_delta(self, text: str) -> list[Frame]:
        frames: list[Frame] = []
        if self._reasoning is None:
            index = self._next_index
            self._next_index += 1
            self._reasoning = (index, [])
            item = {
                "type": "reasoning",
                "id": f"rs_{self._suffix}",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            frames.append(self._event("response.output_item.added", output_index=index, item=item))
        index, so_far = self._reasoning
        so_far.append(text)
        frames.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=f"rs_{self._suffix}",
                output_index=index,
                content_index=0,
                delta=text,
            )
        )
        return frames

    def _close_reasoning(self, final: dict[str, Any] | None = None) -> list[Frame]:
        if self._reasoning is None or self._reasoning_done:
            return []
        self._reasoning_done = True
        index, pieces = self._reasoning
        text = "".join(pieces)
        item_id = f"rs_{self._suffix}"
        item = final or {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed",
        }
        return [
            self._event(
                "response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _text_delta(self, text: str) -> list[Frame]:
        frames: list[Frame] = []
        item_id = f"msg_{self._suffix}"
        if self._message is None:
            index = self._next_index
            self._next_index += 1
            self._message = (index, [])
            item = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            frames.append(self._event("response.output_item.added", output_index=index, item=item))
            frames.append(
                self._event(
                    "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part
                )
            )
        index, so_far = self._message
        so_far.append(text)
        frames.append(
            self._event(
                "response.output_text.delta",
                item_id=item_id,
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return frames

    def _done(self, event: TurnDone) -> list[Frame]:
        result = event.result
        node = result.node
        items = output_items(node)
        by_type: dict[str, dict[str, Any]] = {item["type"]: item for item in items if item["type"] != "function_call"}
        frames = self._close_reasoning(by_type.get("reasoning"))
        if self._message is not None:
            index, pieces = self._message
            text = "".join(pieces)
            item_id = f"msg_{self._suffix}"
            final = by_type.get("message") or {}
            part = (final.get("content") or [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])[
                0
            ]
            frames += [
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
                ),
                self._event("response.output_item.done", output_index=index, item=final),
            ]
        for item in (item for item in items if item["type"] == "function_call"):
            index = self._next_index
            self._next_index += 1
            added = {**item, "arguments": "", "status": "in_progress"}
            frames += [
                self._event("response.output_item.added", output_index=index, item=added),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        body = response_body(
            node, prompt_ids=result.prompt_ids, session=self._session, tools=self._tools, model=self._model
        )
        frames.append(self._event("response.completed", response=body))
        return frames

    def error(self, error: ProxyError) -> list[Frame]:
        return [self._event("error", code=error.code, message=error.message, param=error.param)]
