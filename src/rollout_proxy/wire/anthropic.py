"""The Anthropic Messages API's request shapes, as the proxy's normal form (``wire.messages``).

A Messages request is a ``system`` (a string or text blocks), ``messages`` whose content is a string or
content blocks, and ``tools``. In the normal form:

- ``system`` is the conversation's first message (``role: "system"``), its text blocks joined with
  newlines as every content's are; a ``role: "system"`` message inside the conversation (Claude Code sends
  them) stays where it is;
- a user message's ``tool_result`` blocks become ``tool`` messages (their content a string, or text
  blocks joined), in order, and its text and image blocks around them ``user`` messages; an ``image``
  block (``source``: ``base64`` with its ``media_type``, or ``url``) is an image part (``wire.images``), in
  a user message or a ``tool_result``'s content, which then keeps its parts as a list;
- an assistant message is one assistant message: its text blocks as ``content``, its ``tool_use`` blocks
  as ``tool_calls`` (``input`` encoded as the arguments), its ``thinking`` blocks as
  ``reasoning_content``. A ``redacted_thinking`` block is opaque (the proxy never issues one): accepted,
  and not rendered. A ``thinking`` block's ``signature`` is returned for the caller to check
  (``SignedThinking``): the proxy signs the thinking it answers, so an echoed block names its node;
- custom tools (no ``type``, or ``"custom"``) are rendered as functions with their ``input_schema``;
  tools of any other type (Anthropic's server tools and its versioned client tools: ``web_search_…``,
  ``bash_…``, ``text_editor_…``, ``mcp_toolset``, …) and tools with ``defer_loading`` (not in the model's
  context until a tool search loads them) are left out of the prompt and recorded (``ToolSet.left_out``).

What comes in here has passed the edge's pydantic models (``proxy.anthropic_models``); the functions still
take any JSON value and raise nothing but ``WireFormatError``, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.images import INVALID_IMAGE, ImageSet, decode_base64, inline_image, url_image
from rollout_proxy.wire.messages import ToolSet, arguments_json, describe, function_tool

#: Block types an assistant message may hold; ``redacted_thinking`` is accepted and not rendered.
ASSISTANT_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use"})
#: Block types a user message may hold.
USER_BLOCKS = frozenset({"text", "image", "tool_result"})
#: Block types of a ``tool_result``'s content.
RESULT_BLOCKS = frozenset({"text", "image"})
#: Block types of a system prompt and a system message.
TEXT_ONLY = frozenset({"text"})
#: The tool type rendered as a function (also when ``type`` is left out).
CUSTOM_TOOL = "custom"


@dataclass(frozen=True, slots=True)
class SignedThinking:
    """A ``thinking`` block the client sent with a signature: where it is, and what the signature covers."""

    message: int  # the index of its assistant message in the normalized conversation
    signature: str
    thinking: str
    param: str  # where it was in the request (for an error naming it)


@dataclass(slots=True)
class Conversation:
    """A Messages request's conversation in the normal form, and the signed thinking it carries, folded
    message by message (``add``): each message folds alone, so a resent history is folded once
    (``extended()`` goes on from here without changing what this one holds)."""

    messages: list[dict[str, Any]]
    signed: list[SignedThinking] = field(default_factory=list)
    #: the images the messages hold (None: only named, ``wire.images``; a conversation the proxy keeps has one)
    images: ImageSet | None = field(default_factory=ImageSet)

    @classmethod
    def starting(cls, system: Any, *, param: str = "system", images: ImageSet | None = None) -> Conversation:
        """A conversation that begins with the request's top-level ``system`` (if any)."""
        head = system_message(system, param=param)
        return cls(messages=[] if head is None else [head], images=ImageSet() if images is None else images)

    @property
    def settled(self) -> int:
        """How many of ``messages`` no message added later can change: all of them."""
        return len(self.messages)

    def extended(self) -> Conversation:
        images = None if self.images is None else self.images.extended()
        return Conversation(list(self.messages), list(self.signed), images)

    def upto(self, count: int) -> Conversation:
        """The conversation of the messages that made its first ``count`` (each message folds alone)."""
        kept = self.messages[:count]
        images = None if self.images is None else self.images.upto(kept)
        return Conversation(kept, [block for block in self.signed if block.message < count], images)

    def add(self, message: Any, where: str) -> None:
        """One of the request's ``messages`` (at ``where``), folded into the normal form."""
        if not isinstance(message, dict):
            raise WireFormatError("a message must be an object", param=where)
        role, content = message.get("role"), message.get("content")
        if role == "assistant":
            self.messages.append(_assistant(content, where, len(self.messages), self.signed))
        elif role == "user":
            self.messages.extend(_user(content, where, self.images))
        elif role == "system":
            text = _text_of(content, param=f"{where}.content", allowed=TEXT_ONLY)
            self.messages.append({"role": "system", "content": text})
        else:
            raise WireFormatError(
                f"unknown message role {describe(role)}: user, assistant or system", param=f"{where}.role"
            )


def _text_of(blocks: Any, *, param: str, allowed: frozenset[str]) -> str:
    """Text blocks joined with newlines (as ``wire.messages.content_text`` joins parts)."""
    found = _content_of(blocks, param=param, allowed=allowed, images=None)
    assert isinstance(found, str)  # ``allowed`` takes no image here
    return found


def _content_of(
    blocks: Any, *, param: str, allowed: frozenset[str], images: ImageSet | None, start: int = 0
) -> str | list[Any]:
    """Content in the normal form: text blocks joined with newlines (as ``wire.messages.content_text`` joins
    parts), or, when an image is among them, the parts in order (``start``: the first block's index in
    ``param``)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise WireFormatError("content must be a string or a list of content blocks", param=param)
    parts: list[dict[str, str]] = []
    imaged = False
    for index, block in enumerate(blocks):
        where = f"{param}[{start + index}]"
        kind = _block_type(block, where, allowed)
        if kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", where)})
        elif kind == "image":
            parts.append(_image(block, where, images))
            imaged = True
    return parts if imaged else "\n".join(part["text"] for part in parts)


def _image(block: dict[str, Any], where: str, images: ImageSet | None) -> dict[str, str]:
    """An ``image`` block: ``source`` ``{"type": "base64", "media_type", "data"}`` (the data must be of that
    type, as Anthropic checks it) or ``{"type": "url", "url"}``; a ``file`` source names a file of Anthropic's
    Files API, which the proxy does not have."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise WireFormatError("an image block needs a source object", param=f"{where}.source")
    kind = source.get("type")
    at = f"{where}.source"
    if kind == "base64":
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not media_type:
            raise WireFormatError("a base64 image source needs its media_type", param=f"{at}.media_type")
        data = source.get("data")
        if not isinstance(data, str):
            raise WireFormatError("a base64 image source needs its data as a string", param=f"{at}.data")
        decoded = decode_base64(data, param=f"{at}.data")
        return inline_image(decoded, media_type.lower(), images, param=f"{at}.data", strict=True)
    if kind == "url":
        return url_image(source.get("url"), images, param=f"{at}.url")
    if kind == "file":
        raise WireFormatError(
            "an image by file_id is not taken (the proxy has no Files API): send it inline, as a base64 source",
            param=f"{at}.type",
            code=INVALID_IMAGE,
        )
    raise WireFormatError(f"unsupported image source type {describe(kind)}: base64 or url", param=f"{at}.type")


def _block_type(block: Any, where: str, allowed: frozenset[str]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if isinstance(kind, str) and kind in allowed:
        return kind
    raise WireFormatError(
        f"unsupported content block {describe(kind) if isinstance(block, dict) else describe(block)} here: "
        f"this message takes {', '.join(sorted(allowed))} blocks",
        param=f"{where}.type" if isinstance(block, dict) else where,
    )


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise WireFormatError(f"a {block.get('type')} block needs a string '{key}'", param=f"{where}.{key}")
    return value


def system_message(system: Any, *, param: str = "system") -> dict[str, Any] | None:
    """The top-level ``system`` as the conversation's first message (None when absent or empty)."""
    if system is None:
        return None
    text = _text_of(system, param=param, allowed=TEXT_ONLY)
    return {"role": "system", "content": text} if text else None


def conversation(
    system: Any, messages: Any, *, param: str = "messages", images: ImageSet | None = None
) -> Conversation:
    """A Messages request's ``system`` and ``messages`` in the normal form (see the module docstring)."""
    if not isinstance(messages, list):
        raise WireFormatError("messages must be a list", param=param)
    found = Conversation.starting(system, images=images)
    for index, message in enumerate(messages):
        found.add(message, f"{param}[{index}]")
    return found


def _user(content: Any, where: str, images: ImageSet | None) -> list[dict[str, Any]]:
    """A user message: its tool results as tool messages, its text and image blocks around them as user
    messages."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise WireFormatError("content must be a string or a list of content blocks", param=f"{where}.content")
    out: list[dict[str, Any]] = []
    run: list[Any] = []  # the text and image blocks since the last tool result
    first = 0  # the index of the run's first block
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        if _block_type(block, at, USER_BLOCKS) != "tool_result":
            run.append(block)
            continue
        if run:
            out.append(_user_turn(run, where, first, images))
            run = []
        first = index + 1
        tool_use_id = block.get("tool_use_id")
        if not isinstance(tool_use_id, str) or not tool_use_id:
            raise WireFormatError("a tool_result block needs a tool_use_id", param=f"{at}.tool_use_id")
        result = block.get("content")
        text = (
            "" if result is None else _content_of(result, param=f"{at}.content", allowed=RESULT_BLOCKS, images=images)
        )
        out.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
    if run or not out:
        out.append(_user_turn(run, where, first, images))
    return out


def _user_turn(blocks: list[Any], where: str, first: int, images: ImageSet | None) -> dict[str, Any]:
    """Text and image blocks (the user message's from index ``first`` on) as one user message."""
    content = _content_of(blocks, param=f"{where}.content", allowed=USER_BLOCKS, images=images, start=first)
    return {"role": "user", "content": content}


def _assistant(content: Any, where: str, position: int, signed: list[SignedThinking]) -> dict[str, Any]:
    """An assistant message; its signed thinking blocks are added to ``signed`` (at ``position``)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise WireFormatError("content must be a string or a list of content blocks", param=f"{where}.content")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = _block_type(block, at, ASSISTANT_BLOCKS)
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thinking = _string(block, "thinking", at)
            signature = block.get("signature")
            if signature is not None and not isinstance(signature, str):
                raise WireFormatError("a thinking block's signature must be a string", param=f"{at}.signature")
            if signature:
                signed.append(SignedThinking(position, signature, thinking, f"{at}.signature"))
            if thinking:
                reasoning.append(thinking)
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise WireFormatError("a tool_use block needs an id", param=f"{where}.id")
    if not isinstance(name, str) or not name:
        raise WireFormatError("a tool_use block needs a name", param=f"{where}.name")
    tool_input = block.get("input")
    if not isinstance(tool_input, dict):
        raise WireFormatError("a tool_use block's input must be an object", param=f"{where}.input")
    arguments = arguments_json(tool_input, param=f"{where}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def split_tools(tools: Any, *, param: str = "tools") -> ToolSet:
    """A Messages request's tools: custom tools rendered as functions (Chat Completions form), the others
    left out and recorded (``{"type", ["name"]}``; ``type: "deferred"`` for ``defer_loading`` tools)."""
    if tools is None:
        return ToolSet()
    if not isinstance(tools, list):
        raise WireFormatError("tools must be a list", param=param)
    found = ToolSet(functions=[])
    assert found.functions is not None
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict):
            raise WireFormatError("a tool must be an object", param=where)
        kind = tool.get("type", CUSTOM_TOOL)
        name = tool.get("name")
        if not isinstance(kind, str) or not kind:
            raise WireFormatError("a tool's type must be a string", param=f"{where}.type")
        if not isinstance(name, str) or not name:
            raise WireFormatError("a tool needs a name", param=f"{where}.name")
        if kind != CUSTOM_TOOL or tool.get("defer_loading") is True:
            found.left_out.append({"type": "deferred" if kind == CUSTOM_TOOL else kind, "name": name})
            continue
        if name in names:
            raise WireFormatError(
                f"two tools are named {name!r}: the policy calls tools by name", param=f"{where}.name"
            )
        names.add(name)
        found.functions.append(function_tool(name, tool, at=where, schema_field="input_schema", what="input_schema"))
    return found


def stop_sequences(value: Any, *, param: str = "stop_sequences") -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise WireFormatError("stop_sequences must be a list of non-empty strings", param=param)
    return tuple(value)
