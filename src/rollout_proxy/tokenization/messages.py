"""Content-addressed message paths: what identifies a message, and rolling path hashes.

Messages arrive normalized (``wire.messages``). ``canonical_key`` keeps only what
identifies a message in a conversation (role, content, tool calls by name and parsed
arguments, ``tool_call_id``), so a client that drops the reasoning or re-serializes
tool arguments still matches the node that produced the message. ``path_hashes``
names every prefix of a conversation, so a parent is found with one store read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

EMPTY_PATH_HASH = ""


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
    return extend_path_hash_by_key(parent_hash, canonical_key(message))


def extend_path_hash_by_key(parent_hash: str, key: bytes) -> str:
    """``extend_path_hash`` for a message whose ``canonical_key`` is already known."""
    return hashlib.blake2b(parent_hash.encode() + b"\x00" + key, digest_size=16).hexdigest()


def path_hashes(messages: Iterable[dict[str, Any]], start: str = EMPTY_PATH_HASH) -> list[str]:
    """Rolling hashes: element k names the conversation made of messages[0..k]."""
    hashes = []
    current = start
    for message in messages:
        current = extend_path_hash(current, message)
        hashes.append(current)
    return hashes


def path_hashes_of_keys(keys: Iterable[bytes], start: str = EMPTY_PATH_HASH) -> list[str]:
    """``path_hashes`` of messages whose ``canonical_key``s are already known."""
    hashes = []
    current = start
    for key in keys:
        current = extend_path_hash_by_key(current, key)
        hashes.append(current)
    return hashes


def same_messages(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(canonical_key(x) == canonical_key(y) for x, y in zip(a, b, strict=True))
