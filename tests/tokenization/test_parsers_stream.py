"""The incremental parser: whatever the chunking, the released pieces are exactly the final parse."""

from __future__ import annotations

import itertools
import random

import pytest

from rollout_proxy.tokenization.parsers import OutputParser
from rollout_proxy.tokenization.parsers.base import AssistantView
from rollout_proxy.tokenization.parsers.incremental import IncrementalParser, ViewDelta

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "C"}}</tool_call>'
TEXTS = [
    "",
    "Hello there.",
    "  leading spaces and trailing  \n",
    "<think>plan it</think>\nThe answer is 4.",
    "<think>\n\nmulti\nline\n\n</think>\n\n  spaced answer  ",
    "<think>never closed\n",
    "<think></think>\nempty reasoning",
    "reasoning without the opening tag</think>\nthen content",
    "no reasoning at all, a < and a </thin and <think",
    f"<think>I need the weather.</think>\n{CALL}\n{CALL2}",
    f"Let me check. {CALL} and then {CALL2} done.  ",
    "   " + CALL,
    "<tool_call>{not json}</tool_call> kept as text",
    "text <tool_call>unfinished",
    'text <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}',
    "<tool_call></tool_call>",
    "a <tool_ca b <tool_call c",
    '<think>x</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nafter',
    "héllo wörld ✓ <think>not at start</think> tail",
]
PARSERS = [("hermes", "think"), ("hermes", "none"), ("none", "think"), ("none", "none")]


def released(deltas: list[ViewDelta]) -> tuple[str, str, list[dict]]:
    """What the deltas release together: the reasoning, the content and the calls' functions."""
    calls = [call["function"] for delta in deltas for call in delta.tool_calls]
    return "".join(delta.reasoning for delta in deltas), "".join(delta.content for delta in deltas), calls


def parsed(final: AssistantView) -> tuple[str, str, list[dict]]:
    """The same of the final parse."""
    return final.reasoning or "", final.content or "", [call["function"] for call in final.tool_calls]


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    ways = [[text], list(text)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize(("tools", "reasoning"), PARSERS)
def test_released_pieces_concatenate_to_the_final_parse(tools: str, reasoning: str, opened: bool) -> None:
    """``opened``: the prompt left a <think> block open, and both parses are told so."""
    rng = random.Random(13)
    parser = OutputParser.named(tools, reasoning)
    for text in TEXTS:
        final = parser.parse(text, opened=opened)
        for pieces in chunkings(text, rng):
            incremental = IncrementalParser(parser, opened=opened)
            got_reasoning, got_content, got_calls = "", "", []
            for piece in pieces:
                delta = incremental.feed(piece)
                got_reasoning += delta.reasoning
                got_content += delta.content
                got_calls += delta.tool_calls
            view, rest, agrees = incremental.finish(final)
            assert agrees, (text, pieces)
            got_reasoning += rest.reasoning
            got_content += rest.content
            got_calls += rest.tool_calls
            assert got_reasoning == (final.reasoning or ""), (text, pieces)
            assert got_content == (final.content or ""), (text, pieces)
            assert [c["function"] for c in got_calls] == [c["function"] for c in final.tool_calls]
            assert [c["id"] for c in got_calls] == [c["id"] for c in view.tool_calls]
            assert view.message() | {"tool_calls": None} == final.message() | {"tool_calls": None}


def test_an_unfinished_call_is_never_released_as_content() -> None:
    incremental = IncrementalParser(OutputParser.named("hermes", "think"))
    released = ""
    for piece in ["<think>ok</think>\nSure. ", '<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}']:
        released += incremental.feed(piece).content
    assert released == "Sure."
    delta = incremental.feed("</tool_call>")
    assert [call["function"]["name"] for call in delta.tool_calls] == ["get_weather"]
    assert delta.content == ""


def test_reasoning_streams_before_the_close_tag() -> None:
    incremental = IncrementalParser(OutputParser.named("hermes", "think"))
    assert incremental.feed("<think>\nfirst ").reasoning == "first "
    assert incremental.feed("second\n</thi").reasoning == "second"  # the newline may end the reasoning
    delta = incremental.feed("nk>\n\nAnswer")
    assert (delta.reasoning, delta.content) == ("", "Answer")


def test_a_plain_answer_streams_from_its_first_character() -> None:
    """With a prompt that leaves no <think> open, content is released as it comes, not held for a </think>."""
    incremental = IncrementalParser(OutputParser.named("hermes", "think"))
    assert incremental.feed("On").content == "On"
    assert incremental.feed("ce upon").content == "ce upon"
    assert incremental.feed(" a time").content == " a time"


def test_an_opened_prompt_streams_reasoning_from_the_first_character() -> None:
    incremental = IncrementalParser(OutputParser.named("hermes", "think"), opened=True)
    assert incremental.feed("\nLet me").reasoning == "Let me"
    assert incremental.feed(" think.").reasoning == " think."
    delta = incremental.feed("</think>\n\nFour.")
    assert (delta.reasoning, delta.content) == ("", "Four.")


FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    '{"name": "f", "arguments": {"x": 1}}',
    '{"name": "g"',
    "\n",
    "\n\n",
    "  ",
    " ",
    "word",
    "<",
    "</",
    "<tool_",
    "</thi",
    "é✓",
]


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize(("tools", "reasoning"), PARSERS)
def test_random_texts_and_chunkings(tools: str, reasoning: str, opened: bool) -> None:
    rng = random.Random(1313)
    parser = OutputParser.named(tools, reasoning)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        final = parser.parse(text, opened=opened)
        pieces = rng.choice(chunkings(text, rng))
        incremental = IncrementalParser(parser, opened=opened)
        deltas = [incremental.feed(piece) for piece in pieces]
        _view, rest, agrees = incremental.finish(final)
        deltas.append(rest)
        assert agrees, (text, pieces)
        assert released(deltas) == parsed(final), (text, pieces)


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize(("tools", "reasoning"), PARSERS)
def test_long_texts_in_many_small_pieces(tools: str, reasoning: str, opened: bool) -> None:
    """Long reasonings, answers and calls (what the parser keeps of them is trimmed as it goes), cut into
    pieces of a few characters: a tag, a newline run or a whitespace run falls across many pieces."""
    rng = random.Random(4242)
    parser = OutputParser.named(tools, reasoning)
    long_fragments = [
        *FRAGMENTS,
        " word" * 40,
        "\n" * 9,
        " " * 9,
        '{"name": "f", "arguments": {"x": "' + "y" * 300 + '"}}',
    ]
    for _ in range(60):
        text = "".join(rng.choice(long_fragments) for _ in range(rng.randint(20, 80)))
        final = parser.parse(text, opened=opened)
        cuts = [0]
        while cuts[-1] < len(text):
            cuts.append(min(len(text), cuts[-1] + rng.randint(1, 7)))
        incremental = IncrementalParser(parser, opened=opened)
        deltas = [incremental.feed(text[a:b]) for a, b in itertools.pairwise(cuts)]
        whole = IncrementalParser(parser, opened=opened).feed(text)  # the same text in one piece
        assert released(deltas) == released([whole]), text  # as much released before the end
        _view, rest, agrees = incremental.finish(final)
        assert agrees, text
        assert released([*deltas, rest]) == parsed(final), text
        assert incremental.text == text
