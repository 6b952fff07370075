"""Chat messages and tools in one normal form.

Clients send and echo messages in many shapes (the openai SDK's ``model_dump()`` with its
null fields, content as a string or as text parts, with or without the reasoning).
``normalize_message`` gives the one form the proxy stores and renders and the SDK keeps:
``{"role", "content", ["name"], ["tool_calls"], ["reasoning_content"], ["tool_call_id"]}``
with text content and JSON-string tool arguments.
"""

from __future__ import annotations

from typing import Any

import orjson

from rollout_proxy.wire.errors import WireFormatError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def content_text(content: Any, *, param: str = "messages") -> str | None:
    """Content as one string: text parts are joined with newlines, as vLLM does."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, dict):  # a single part, as some datasets store it
        content = [content]
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise WireFormatError(
                    f"only text content parts are supported, got {kind!r}",
                    param=f"{param}.content[{index}]",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise WireFormatError("a text part needs a string 'text'", param=f"{param}.content[{index}].text")
            texts.append(text)
        return "\n".join(texts)
    raise WireFormatError("content must be a string, a list of text parts or null", param=f"{param}.content")


def _normalize_tool_calls(tool_calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise WireFormatError("tool_calls must be a list", param=param)
    normalized = []
    for index, call in enumerate(tool_calls):
        where = f"{param}[{index}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise WireFormatError("a tool call needs a 'function' object", param=where)
        function = call["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise WireFormatError("a tool call needs a function name", param=f"{where}.function.name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments).decode()
        normalized.append(
            {
                "id": call.get("id") or f"call_{index}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return normalized


def normalize_message(message: Any, *, param: str = "messages") -> dict[str, Any]:
    """The stored and rendered form of a message; raises WireFormatError on bad shapes."""
    if not isinstance(message, dict):
        raise WireFormatError("a message must be an object", param=param)
    role = message.get("role")
    if role not in ROLES:
        raise WireFormatError(f"unknown message role {role!r}", param=f"{param}.role")
    normalized: dict[str, Any] = {"role": role, "content": content_text(message.get("content"), param=param)}
    if role != "assistant" and normalized["content"] is None:
        raise WireFormatError(f"a {role} message needs content", param=f"{param}.content")
    if message.get("name"):
        normalized["name"] = message["name"]
    if role == "assistant":
        if message.get("tool_calls"):
            normalized["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"{param}.tool_calls")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            normalized["reasoning_content"] = reasoning
    if role == "tool":
        tool_call_id = message.get("tool_call_id")
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise WireFormatError("a tool message needs a tool_call_id", param=f"{param}.tool_call_id")
        normalized["tool_call_id"] = tool_call_id
    return normalized


def normalize_messages(messages: Any, *, param: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise WireFormatError("messages must be a list", param=param)
    return [normalize_message(message, param=f"{param}[{index}]") for index, message in enumerate(messages)]


def normalize_tools(tools: Any, *, param: str = "tools") -> list[dict[str, Any]] | None:
    """Function tools in Chat Completions form; the flat Responses form is accepted too."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise WireFormatError("tools must be a list", param=param)
    normalized = []
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise WireFormatError("only function tools are supported", param=where)
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise WireFormatError("a function tool needs a name", param=where)
        spec = {"name": function["name"]}
        if function.get("description") is not None:
            spec["description"] = function["description"]
        spec["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        normalized.append({"type": "function", "function": spec})
    return normalized
