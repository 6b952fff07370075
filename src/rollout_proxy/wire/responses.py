"""Responses API input items and answers, as messages.

Input items: messages (string or content parts: text, and a user message's ``input_image``),
``function_call_output`` (its output a string, or text and ``input_image`` parts), and prior
``function_call`` / ``reasoning`` items echoed back by clients (folded into the
assistant message they came from). The other direction, for replaying a conversation
where nothing is stored: a conversation as input items, and the assistant message an
answer stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.images import ImageSet
from rollout_proxy.wire.messages import arguments_json, content_parts, describe, normalize_message


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The text of a reasoning item: its ``content`` parts, else its ``summary`` parts."""
    field = "content" if item.get("content") else "summary"
    parts = item.get(field) or []
    if not isinstance(parts, list):
        raise WireFormatError(f"a reasoning item's {field} must be a list of parts", param=f"{where}.{field}")
    texts = []
    for index, part in enumerate(parts):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise WireFormatError("a reasoning part needs a string 'text'", param=f"{where}.{field}[{index}]")
        texts.append(text)
    return "\n".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
        raise WireFormatError("a function_call item needs call_id and name", param=where)
    arguments = arguments_json(item.get("arguments") or "{}", param=f"{where}.arguments")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def input_to_messages(value: Any, *, param: str = "input", images: ImageSet | None = None) -> list[dict[str, Any]]:
    """Responses ``input`` as normalized chat messages (their images joining ``images``, ``wire.images``)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise WireFormatError("input must be a string or a list of items", param=param)
    fold = InputFold(images=images)
    for index, item in enumerate(value):
        fold.add(item, f"{param}[{index}]")
    return fold.messages


@dataclass(slots=True)
class InputFold:
    """Input items folded into messages one by one (``input_to_messages``), so a resent input's items are
    folded once: ``extended()`` goes on from here without changing what this fold holds. A
    ``function_call`` joins the assistant message before it (a copy of it), a ``reasoning`` item waits for
    the assistant message or call it belongs to."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None
    #: the images the messages hold (None: only named, ``wire.images``; a fold the proxy keeps always has one)
    images: ImageSet | None = field(default_factory=ImageSet)

    @property
    def settled(self) -> int:
        """How many of ``messages`` no item added later can change (a last assistant message can take calls)."""
        return (
            len(self.messages) - 1 if self.messages and self.messages[-1]["role"] == "assistant" else len(self.messages)
        )

    def extended(self) -> InputFold:
        return InputFold(list(self.messages), self.reasoning, None if self.images is None else self.images.extended())

    def upto(self, count: int) -> InputFold | None:
        """None: a later item may have changed an earlier message (a call joins the assistant message
        before it), so only a list that resends the last one whole goes on from a fold."""
        return None

    def add(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise WireFormatError("an input item must be an object", param=where)
        messages = self.messages
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            message = normalize_message(
                {"role": item.get("role"), "content": item.get("content")}, param=where, images=self.images
            )
            if message["role"] == "assistant" and self.reasoning:
                message["reasoning_content"], self.reasoning = self.reasoning, None
            messages.append(message)
        elif kind == "reasoning":
            self.reasoning = _reasoning_text(item, where) or None
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if self.reasoning:
                    message["reasoning_content"], self.reasoning = self.reasoning, None
                messages.append(normalize_message(message, param=where))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise WireFormatError("a function_call_output item needs call_id", param=where)
            output = content_parts(
                item.get("output"), param=where, field="output", images=self.images, takes_images=True
            )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output or ""})
        else:
            raise WireFormatError(f"unsupported input item type {describe(kind)}", param=f"{where}.type")


def as_dict(value: Any) -> dict[str, Any]:
    """An openai SDK object (or a plain mapping) as a dict."""
    return value.model_dump() if hasattr(value, "model_dump") else dict(value)


def assistant_message_of_response(response: Any) -> dict[str, Any]:
    """The assistant message a Responses API answer stands for."""
    reasoning, text, calls = [], [], []
    for item in as_dict(response).get("output") or []:
        kind = item.get("type")
        if kind == "reasoning":
            reasoning += [part.get("text", "") for part in (item.get("content") or item.get("summary") or [])]
        elif kind == "message":
            text += [part.get("text", "") for part in item.get("content") or [] if part.get("type") == "output_text"]
        elif kind == "function_call":
            function = {"name": item["name"], "arguments": item.get("arguments") or "{}"}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def messages_as_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A whole conversation as Responses input items (to replay it where nothing is stored)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            )
        elif message["role"] == "assistant":
            if message.get("content"):
                items.append({"role": "assistant", "content": message["content"]})
            for call in message.get("tool_calls") or []:
                function = call["function"]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": function["name"],
                        "arguments": function["arguments"],
                    }
                )
        else:
            items.append({"role": message["role"], "content": message["content"]})
    return items
