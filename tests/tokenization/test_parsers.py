"""Generated text to assistant message views."""

from __future__ import annotations

import json

import pytest

from rollout_proxy.tokenization.parsers import OutputParser, ToolParse
from rollout_proxy.tokenization.parsers.hermes import HermesToolParser

PARSER = OutputParser.named("hermes", "think")


def test_reasoning_and_content():
    view = PARSER.parse("<think>\nstep one\n</think>\n\nThe answer is 4.")
    assert view.reasoning == "step one" and view.content == "The answer is 4." and not view.tool_calls


def test_reasoning_without_opening_tag_when_the_prompt_opened_it():
    view = PARSER.parse("the template opened it</think>Done.", opened=True)
    assert view.reasoning == "the template opened it" and view.content == "Done."


def test_a_close_tag_is_content_when_nothing_opened_reasoning():
    """Whether the output starts inside <think> is the prompt's to say, not a guess from a later </think>."""
    view = PARSER.parse("Use </think> to end reasoning.")
    assert view.reasoning is None and view.content == "Use </think> to end reasoning."


def test_unterminated_reasoning_is_all_reasoning():
    view = PARSER.parse("<think>I was cut off mid-thou")
    assert view.reasoning == "I was cut off mid-thou" and view.content == ""
    view = PARSER.parse("cut off mid-thou", opened=True)
    assert view.reasoning == "cut off mid-thou" and view.content == ""


@pytest.mark.parametrize(
    ("generation_prompt", "opened"),
    [
        ("\n<|im_start|>assistant\n", False),
        ("\n<|im_start|>assistant\n<think>\n", True),
        ("\n<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking false
        ("<｜Assistant｜><think>\n", True),  # DeepSeek-R1
    ],
)
def test_whether_a_generation_prompt_opens_reasoning(generation_prompt, opened):
    assert PARSER.reasoning.opened_by(generation_prompt) is opened
    assert OutputParser.named("hermes", "none").reasoning.opened_by(generation_prompt) is False


def test_hermes_tool_calls():
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    view = PARSER.parse(text)
    assert view.tool_parse is ToolParse.CALLS
    assert [call["function"]["name"] for call in view.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(view.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert view.content == "Checking."
    assert len({call["id"] for call in view.tool_calls}) == 2


def test_tool_call_only_has_null_content():
    view = PARSER.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert view.content is None and view.message()["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": \n</tool_call>',  # broken JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}',  # cut off before the closing tag
    ],
)
def test_malformed_calls_stay_in_content(text):
    view = PARSER.parse(text)
    assert view.tool_parse is ToolParse.MALFORMED and not view.tool_calls
    assert "<tool_call>" in view.content


def test_parsers_can_be_turned_off():
    text = '<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    view = OutputParser.named("none", "none").parse(text)
    assert view.content == text and view.reasoning is None and not view.tool_calls


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="unknown tool parser"):
        OutputParser.named("xml", "think")


@pytest.mark.parametrize("depth", [100, 5000])
def test_a_call_nested_deeper_than_can_be_stored_stays_text(depth):
    """A model can write anything: arguments nested past what a store encodes (or past Python's
    recursion limit) are a malformed call kept as content, never an error."""
    arguments = "[" * depth + "]" * depth
    text = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    content, calls, outcome = HermesToolParser().extract(text)
    assert calls == [] and outcome is ToolParse.MALFORMED and content == text
