"""Message identity and path hashes: echoes the way clients send them match the node that produced them.

Normalization itself is tested with the wire package (tests/wire/test_messages.py)."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionMessage

from rollout_proxy.tokenization.messages import (
    EMPTY_PATH_HASH,
    canonical_key,
    extend_path_hash,
    path_hashes,
    same_messages,
)
from rollout_proxy.wire.messages import normalize_message

PRODUCED = {
    "role": "assistant",
    "content": "Let me check.",
    "reasoning_content": "The user wants weather.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
        }
    ],
}


def key(message):
    return canonical_key(normalize_message(message))


def test_sdk_model_dump_with_null_fields_matches():
    dumped = ChatCompletionMessage.model_validate(PRODUCED).model_dump()
    assert dumped["refusal"] is None and dumped["audio"] is None  # the SDK's null fields
    assert key(dumped) == key(PRODUCED)


@pytest.mark.parametrize(
    "variant",
    [
        {**PRODUCED, "reasoning_content": None},  # the client dropped the reasoning
        {k: v for k, v in PRODUCED.items() if k != "reasoning_content"},
        {**PRODUCED, "content": [{"type": "text", "text": "Let me check."}]},  # text parts
        {
            **PRODUCED,
            "tool_calls": [
                {
                    "id": "other-id",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit":"C","city":"Paris"}'},
                }
            ],
        },
    ],
)
def test_echo_variants_match(variant):
    assert key(variant) == key(PRODUCED)


@pytest.mark.parametrize(
    "variant",
    [
        {**PRODUCED, "content": "Let me check!"},
        {
            **PRODUCED,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {**PRODUCED, "tool_calls": None},
        {**PRODUCED, "role": "user"},
    ],
)
def test_real_differences_do_not_match(variant):
    assert key(variant) != key(PRODUCED)


def test_tool_call_id_matters_for_tool_messages():
    assert key({"role": "tool", "tool_call_id": "a", "content": "x"}) != key(
        {"role": "tool", "tool_call_id": "b", "content": "x"}
    )


def test_empty_and_null_assistant_content_match():
    assert key({"role": "assistant", "content": None}) == key({"role": "assistant", "content": ""})


def test_path_hashes_are_rolling():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    full = path_hashes(messages)
    assert len(full) == 2 and full[0] == path_hashes(messages[:1])[0]
    assert path_hashes(messages[1:], start=full[0]) == full[1:]
    assert path_hashes(list(reversed(messages)))[-1] != full[-1]


def test_a_path_hash_extends_its_parents():
    message = {"role": "user", "content": "a"}
    assert path_hashes([message]) == [extend_path_hash(EMPTY_PATH_HASH, message)]
    assert extend_path_hash("parent-1", message) != extend_path_hash("parent-2", message)


def test_same_messages_compares_identities_and_lengths():
    produced = normalize_message(PRODUCED)
    echoed = normalize_message({**PRODUCED, "reasoning_content": None})
    assert same_messages([produced], [echoed])
    assert not same_messages([produced], [produced, produced])
    assert not same_messages([produced], [{**echoed, "content": "other"}])
