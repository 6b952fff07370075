"""Render checks of templates/qwen3_style.jinja with plain jinja2, set up like transformers'
chat-template environment (sandboxed, trim_blocks/lstrip_blocks, tojson without ASCII
escaping) so these tests need neither torch nor a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import devtools

TEMPLATE = Path(devtools.__file__).parent / "templates" / "qwen3_style.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0])
    + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def _tojson(x, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@pytest.fixture(scope="module")
def render():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    tpl = env.from_string(TEMPLATE.read_text())

    def _render(messages, tools=None, add_generation_prompt=True, **kwargs):
        return tpl.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)

    return _render


def user(text):
    return {"role": "user", "content": text}


def test_no_tools_no_default_system_prompt(render):
    assert render([user("Hi")]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_system_without_tools(render):
    out = render([{"role": "system", "content": "Be brief."}, user("Hi")])
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tools_without_system_gets_tools_only_system_turn(render):
    out = render([user("Weather?")], tools=TOOLS)
    assert out == (
        "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_appended_to_system_message(render):
    out = render([{"role": "system", "content": "Be brief."}, user("Weather?")], tools=TOOLS)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n" + TOOLS_BLOCK)
    assert out.count("<|im_start|>system") == 1


def test_tool_calls_and_merged_tool_responses(render):
    msgs = [
        user("Paris and Rome?"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    out = render(msgs, tools=TOOLS)
    body = out[out.index("<|im_start|>user") :]
    assert body == (
        "<|im_start|>user\nParis and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_call_after_content_is_on_new_line(render):
    msgs = [
        user("Q"),
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
        },
    ]
    out = render(msgs, add_generation_prompt=False)
    assert 'Checking.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>' in out


def test_think_stripped_from_turns_before_last_query(render):
    msgs = [
        user("Q1"),
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA1"},
        {"role": "assistant", "content": "A1b", "reasoning_content": "old too"},
        user("Q2"),
    ]
    out = render(msgs)
    assert "reasoning" not in out and "old too" not in out and "<think>" not in out
    assert "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>assistant\nA1b<|im_end|>" in out


def test_think_kept_after_last_query_in_tool_loop(render):
    msgs = [
        user("Q1"),
        {"role": "assistant", "content": "<think>early</think>A1"},
        user("Q2"),
        {
            "role": "assistant",
            "reasoning_content": "\nneed weather\n",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "<think>got it</think>\n\nIt is sunny."},
    ]
    out = render(msgs, add_generation_prompt=False)
    assert "early" not in out
    assert "<|im_start|>assistant\n<think>\nneed weather\n</think>\n\n<tool_call>" in out
    assert out.endswith("<|im_start|>assistant\n<think>\ngot it\n</think>\n\nIt is sunny.<|im_end|>\n")


def test_wrapped_tool_response_user_message_is_not_a_query(render):
    msgs = [
        user("Q"),
        {"role": "assistant", "content": "<think>r</think>call"},
        user("<tool_response>\nok\n</tool_response>"),
    ]
    assert "<think>\nr\n</think>\n\ncall" in render(msgs)


def test_final_assistant_after_query_gets_empty_think_block(render):
    out = render([user("Q"), {"role": "assistant", "content": "A"}], add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n")
    # ...but not when it is followed by another turn (and has no reasoning)
    out = render([user("Q"), {"role": "assistant", "content": "A"}, {"role": "tool", "content": "x"}])
    assert "<|im_start|>assistant\nA<|im_end|>" in out


def test_enable_thinking_false(render):
    out = render([user("Hi")], enable_thinking=False)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render([user("Hi")], enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_content_as_text_parts(render):
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "S"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert render(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )


def test_no_generation_prompt(render):
    assert render([user("Hi")], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
