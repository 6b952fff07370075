"""ChatRenderer against the fake engine's real chat templates (Qwen3-style and SmolLM2's own).

The exactness rule: a bridge after a parent conversation H equals the engine's render of
H + the new messages, cut right after H's last end-of-turn token (counting end-of-turn
tokens, not comparing prefixes, since a template may render H differently once more follows).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest

from devtools.fake_engine import FakeEngine
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import MessagesMergeIntoParent, ProxyError
from rollout_proxy.tokenization.renderer import ChatRenderer
from tests.harness import WEATHER_TOOL

SYSTEM = {"role": "system", "content": "You answer in one sentence."}
USER = {"role": "user", "content": "What's the weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# content "" rather than None: SmolLM2's template concatenates content as a string
ASSISTANT_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL]}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}
ANSWER = {"role": "assistant", "content": "It is 18C and sunny.", "reasoning_content": "The tool said 18C."}
FOLLOW_UP = {"role": "user", "content": "And tomorrow?"}

#: parents ending with each role, and messages that may follow them
HISTORIES = {
    "assistant": ([USER, ANSWER], [FOLLOW_UP]),
    "assistant_with_system": ([SYSTEM, USER, ANSWER], [FOLLOW_UP]),
    "tool": ([USER, ASSISTANT_CALL, TOOL], [FOLLOW_UP]),
    "user": ([USER], [{"role": "user", "content": "Please be quick."}]),
    "system": ([SYSTEM], [USER]),
    "assistant_then_tool": ([USER, ASSISTANT_CALL], [TOOL]),
}


class CountingEngine:
    """The engine client, counting the template renders it is asked for."""

    def __init__(self, inner: VLLMEngine) -> None:
        self._inner = inner
        self.url = inner.url
        self.returns_routing = None
        self.renders = 0

    async def tokenize_messages(self, messages, **kwargs: Any) -> np.ndarray:
        self.renders += 1
        return await self._inner.tokenize_messages(messages, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
async def engine(fake_engine: FakeEngine) -> AsyncIterator[CountingEngine]:
    inner = VLLMEngine(fake_engine.url)
    yield CountingEngine(inner)
    await inner.close()


@pytest.fixture
def renderer(engine: CountingEngine) -> ChatRenderer:
    return ChatRenderer(engine)


def end_of_turn(fake: FakeEngine) -> int:
    return fake.tokenizer.convert_tokens_to_ids("<|im_end|>")


def engine_render(fake: FakeEngine, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
    """What the engine's /tokenize gives for a conversation."""
    return fake.encode(fake.render(list(messages), **kwargs))


def closed(fake: FakeEngine, ids: list[int]) -> list[int]:
    """Cut after the last end-of-turn token."""
    last = max(i for i, token in enumerate(ids) if token == end_of_turn(fake))
    return ids[: last + 1]


def expected_bridge(
    fake: FakeEngine,
    history: list[dict[str, Any]],
    new: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The suffix of a full render that follows H's last end-of-turn token."""
    turns = engine_render(fake, history, tools=tools, add_generation_prompt=False).count(end_of_turn(fake))
    full = engine_render(fake, [*history, *new], tools=tools, add_generation_prompt=add_generation_prompt)
    cut = [i for i, token in enumerate(full) if token == end_of_turn(fake)][turns - 1]
    suffix = full[cut + 1 :]
    return suffix if add_generation_prompt else closed(fake, suffix)


def tools_for(template_name: str) -> list[dict[str, Any]] | None:
    """SmolLM2's template ignores tools; the Qwen3-style one renders them in the system turn."""
    return [WEATHER_TOOL] if template_name == "qwen3_style" else None


async def test_end_of_turn_is_im_end(renderer, fake_engine):
    assert await renderer.end_of_turn_id() == end_of_turn(fake_engine)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
async def test_render_of_a_root_conversation_is_the_engines(
    renderer, fake_engine, template_name, add_generation_prompt
):
    messages = [SYSTEM, USER, ASSISTANT_CALL, TOOL]
    tools = tools_for(template_name)
    ids = await renderer.render(
        messages, tools=tools, chat_template_kwargs=None, add_generation_prompt=add_generation_prompt
    )
    full = engine_render(fake_engine, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert ids.tolist() == (full if add_generation_prompt else closed(fake_engine, full))
    if not add_generation_prompt:
        assert ids[-1] == end_of_turn(fake_engine) and len(full) == len(ids) + 1  # the trailing newline


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("shape", list(HISTORIES))
async def test_bridge_is_the_suffix_of_a_full_render(
    renderer, fake_engine, template_name, shape, add_generation_prompt
):
    history, new = HISTORIES[shape]
    tools = tools_for(template_name)
    bridge = await renderer.bridge(
        new,
        after_role=history[-1]["role"],
        after_closed=True,
        tools=tools,
        chat_template_kwargs=None,
        add_generation_prompt=add_generation_prompt,
    )
    expected = expected_bridge(fake_engine, history, new, tools=tools, add_generation_prompt=add_generation_prompt)
    assert bridge.tolist() == expected


async def test_parent_plus_bridge_is_the_full_render_when_nothing_is_rewritten(renderer, fake_engine):
    """(Qwen3 rewrites a final assistant turn once a user follows, so the parent here ends with a tool result.)"""
    history = [SYSTEM, USER, ASSISTANT_CALL, TOOL]
    parent = closed(fake_engine, engine_render(fake_engine, history, add_generation_prompt=False))
    bridge = await renderer.bridge(
        [FOLLOW_UP],
        after_role="tool",
        after_closed=True,
        tools=None,
        chat_template_kwargs=None,
        add_generation_prompt=True,
    )
    assert parent + bridge.tolist() == engine_render(fake_engine, [*history, FOLLOW_UP], add_generation_prompt=True)


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_history_rewriting_templates_keep_the_bridge_exact(renderer, fake_engine, template_name):
    """Qwen3 drops earlier <think> once a new user turn follows: the bridge is still the full render's tail."""
    history = [USER, ANSWER]
    alone = fake_engine.render(history, add_generation_prompt=False)
    following = fake_engine.render([*history, FOLLOW_UP], add_generation_prompt=True)
    assert "<think>" in alone and "<think>" not in following  # the template does rewrite history
    bridge = await renderer.bridge(
        [FOLLOW_UP],
        after_role="assistant",
        after_closed=True,
        tools=None,
        chat_template_kwargs=None,
        add_generation_prompt=True,
    )
    assert fake_engine.decode(bridge.tolist()) == "\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    assert bridge.tolist() == expected_bridge(fake_engine, history, [FOLLOW_UP], add_generation_prompt=True)


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_chat_template_kwargs_reach_the_generation_prompt(renderer, fake_engine, template_name):
    kwargs = {"enable_thinking": False}
    bridge = await renderer.bridge(
        [FOLLOW_UP],
        after_role="assistant",
        after_closed=True,
        tools=None,
        chat_template_kwargs=kwargs,
        add_generation_prompt=True,
    )
    assert fake_engine.decode(bridge.tolist()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("template_name", ["smollm2_default"])
async def test_a_default_system_prompt_is_not_bridged_again(renderer, fake_engine, template_name):
    """SmolLM2 injects its system prompt when a conversation has none: it belongs to the root only."""
    assert "You are a helpful AI assistant named SmolLM" in fake_engine.render([USER], add_generation_prompt=False)
    bridge = await renderer.bridge(
        [FOLLOW_UP],
        after_role="assistant",
        after_closed=True,
        tools=None,
        chat_template_kwargs=None,
        add_generation_prompt=True,
    )
    assert "SmolLM" not in fake_engine.decode(bridge.tolist())
    assert bridge.tolist() == expected_bridge(fake_engine, [USER, ANSWER], [FOLLOW_UP], add_generation_prompt=True)


async def test_an_unclosed_parent_gets_the_end_of_turn_first(renderer, fake_engine):
    arguments = {
        "after_role": "assistant",
        "tools": None,
        "chat_template_kwargs": None,
        "add_generation_prompt": True,
    }
    closed_bridge = await renderer.bridge([FOLLOW_UP], after_closed=True, **arguments)
    cut_bridge = await renderer.bridge([FOLLOW_UP], after_closed=False, **arguments)
    assert cut_bridge[0] == end_of_turn(fake_engine)
    assert cut_bridge[1:].tolist() == closed_bridge.tolist()


async def test_the_anchor_turn_count_is_learned_once_per_shape(renderer, engine):
    async def bridge(role: str, tools=None):
        await renderer.bridge(
            [FOLLOW_UP],
            after_role=role,
            after_closed=True,
            tools=tools,
            chat_template_kwargs=None,
            add_generation_prompt=True,
        )

    await renderer.end_of_turn_id()
    engine.renders = 0
    await bridge("assistant")
    assert engine.renders == 2  # the anchor alone, then anchor + new messages
    await bridge("assistant")
    assert engine.renders == 3  # only the new render
    await bridge("tool")
    assert engine.renders == 5  # another shape: its anchor again
    await bridge("assistant", tools=[WEATHER_TOOL])
    assert engine.renders == 7  # tools change the anchor's render too
    await bridge("assistant", tools=[WEATHER_TOOL])
    assert engine.renders == 8


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_a_tool_result_after_a_tool_parent_is_never_dropped(renderer, fake_engine, template_name):
    second = {"role": "tool", "tool_call_id": "call_1", "content": "and windy"}
    try:
        bridge = await renderer.bridge(
            [second],
            after_role="tool",
            after_closed=True,
            tools=[WEATHER_TOOL],
            chat_template_kwargs=None,
            add_generation_prompt=True,
        )
    except ProxyError:
        return  # refusing is acceptable: the policy never sees a result it was not shown
    assert "and windy" in fake_engine.decode(bridge.tolist())


@pytest.mark.parametrize("after", ["assistant", "user"])
async def test_a_developer_message_the_engine_moves_before_fixed_turns_is_refused(renderer, after):
    """vLLM 0.32 merges every system message into the first one once it turns a developer message into one
    (a template with no developer branch): the parent's tokens cannot change, so no bridge is exact."""
    with pytest.raises(MessagesMergeIntoParent):
        await renderer.bridge(
            [{"role": "developer", "content": "Now be terse."}, FOLLOW_UP],
            after_role=after,
            after_closed=True,
            tools=None,
            chat_template_kwargs=None,
            add_generation_prompt=True,
        )
