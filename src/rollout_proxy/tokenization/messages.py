"""Chat messages: one normal form, and content-addressed path hashes.

Clients echo messages back in many shapes (the openai SDK's ``model_dump()`` with its
null fields, content as a string or as text parts, with or without the reasoning).
``normalize_message`` gives the one form we store and send to the engine;
``canonical_key`` keeps only what identifies a message in a conversation (role,
content, tool calls by name and parsed arguments, ``tool_call_id``), so a client that
drops the reasoning or re-serializes tool arguments still matches the node that
produced the message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from rollout_proxy.errors import InvalidRequest

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
EMPTY_PATH_HASH = ""


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
                raise InvalidRequest(
                    f"only text content parts are supported, got {kind!r}",
                    param=f"{param}.content[{index}]",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest("a text part needs a string 'text'", param=f"{param}.content[{index}].text")
            texts.append(text)
        return "\n".join(texts)
    raise InvalidRequest("content must be a string, a list of text parts or null", param=f"{param}.content")


def _normalize_tool_calls(tool_calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise InvalidRequest("tool_calls must be a list", param=param)
    normalized = []
    for index, call in enumerate(tool_calls):
        where = f"{param}[{index}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise InvalidRequest("a tool call needs a 'function' object", param=where)
        function = call["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a tool call needs a function name", param=f"{where}.function.name")
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
    """The stored and rendered form of a message; raises InvalidRequest on bad shapes."""
    if not isinstance(message, dict):
        raise InvalidRequest("a message must be an object", param=param)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"unknown message role {role!r}", param=f"{param}.role")
    normalized: dict[str, Any] = {"role": role, "content": content_text(message.get("content"), param=param)}
    if role != "assistant" and normalized["content"] is None:
        raise InvalidRequest(f"a {role} message needs content", param=f"{param}.content")
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
            raise InvalidRequest("a tool message needs a tool_call_id", param=f"{param}.tool_call_id")
        normalized["tool_call_id"] = tool_call_id
    return normalized


def normalize_messages(messages: Any, *, param: str = "messages") -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise InvalidRequest("messages must be a list", param=param)
    return [normalize_message(message, param=f"{param}[{index}]") for index, message in enumerate(messages)]


def _parsed_arguments(arguments: str) -> Any:
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments


def canonical_key(message: dict[str, Any]) -> bytes:
    """What identifies a normalized message: reasoning and tool-call ids are left out."""
    key: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        key["tool_calls"] = [
            [call["function"]["name"], _parsed_arguments(call["function"]["arguments"])]
            for call in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        key["tool_call_id"] = message["tool_call_id"]
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


def extend_path_hash(parent_hash: str, message: dict[str, Any]) -> str:
    digest = hashlib.blake2b(parent_hash.encode() + b"\x00" + canonical_key(message), digest_size=16)
    return digest.hexdigest()


def path_hashes(messages: Iterable[dict[str, Any]], start: str = EMPTY_PATH_HASH) -> list[str]:
    """Rolling hashes: element k names the conversation made of messages[0..k]."""
    hashes = []
    current = start
    for message in messages:
        current = extend_path_hash(current, message)
        hashes.append(current)
    return hashes


def same_messages(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(canonical_key(x) == canonical_key(y) for x, y in zip(a, b, strict=True))


def normalize_tools(tools: Any, *, param: str = "tools") -> list[dict[str, Any]] | None:
    """Function tools in Chat Completions form; the flat Responses form is accepted too."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param=param)
    normalized = []
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest("only function tools are supported", param=where)
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest("a function tool needs a name", param=where)
        spec = {"name": function["name"]}
        if function.get("description") is not None:
            spec["description"] = function["description"]
        spec["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        normalized.append({"type": "function", "function": spec})
    return normalized
