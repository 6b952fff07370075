"""Assistant messages echoed back as harness libraries send them extend the turn they echo.

litellm drops an assistant message's ``content`` when it is null, the openai SDK's ``model_dump()`` keeps
``content: null``, others send ``""`` or a list of text parts; with or without ``tool_calls``, with or
without the reasoning, and with a system message of the client's own that the session's sample lacks.
Each echo must attach under the node that produced it (no fork, no new root), and the trajectory must be
exactly what the engine was given and sampled. Runs over both stores and both chat templates.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_proxy.engines.vllm_http import is_routing_probe
from rollout_proxy.proxy import keys
from tests.harness import WEATHER_TOOL, ProxyHarness

TASK = "What is the weather in Paris?"
SYSTEM = {"role": "system", "content": "You answer weather questions."}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = {
    # (what the policy samples, the content the client sees)
    "tool_call": ("<think>\nCheck the tool.\n</think>\n\n" + CALL, ""),
    "text_and_tool_call": ("I will check.\n" + CALL, "I will check."),
    "reasoning_only": ("<think>\nNothing to say.\n</think>\n\n", ""),
}
#: how the echoed assistant message carries its content
CONTENT = {
    "missing": lambda text: {} if not text else {"content": text},
    "null": lambda text: {"content": text or None},
    "empty": lambda text: {"content": text},
    "parts": lambda text: {"content": [{"type": "text", "text": text}] if text else []},
}
ANSWER = "It is 18C in Paris."


def echo(message: Any, content: str, *, reasoning: bool) -> dict[str, Any]:
    """The assistant message as a client sends it back."""
    echoed: dict[str, Any] = {"role": "assistant", **CONTENT[content](message.content or "")}
    if message.tool_calls:
        echoed["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if reasoning and (message.model_extra or {}).get("reasoning_content"):
        echoed["reasoning_content"] = message.model_extra["reasoning_content"]
    return echoed


def assert_exact(trajectory: dict[str, Any], proxy: ProxyHarness, *, turns: int) -> None:
    """Each engine call's prompt is the trajectory so far, its tokens follow with weight 1, the rest is 0."""
    fake = proxy.fake
    assert fake is not None
    calls = [generation for generation in fake.generations if not is_routing_probe(generation.payload)]
    assert len(calls) == turns
    total, expected = trajectory["total_token_ids"], [0.0] * len(trajectory["total_token_ids"])
    for generation in calls:
        prompt, sampled = generation.prompt, generation.tokens
        assert total[: len(prompt)] == prompt
        assert total[len(prompt) : len(prompt) + len(sampled)] == sampled
        for offset in range(len(sampled)):
            expected[len(prompt) + offset] = 1.0
    assert len(total) == len(calls[-1].prompt) + len(calls[-1].tokens)
    assert trajectory["total_loss_weight"] == expected
    assert fake.decode(total).count(TASK) == 1


#: (reply, whether the echo keeps the reasoning): a reply without reasoning has none to keep
ECHOES = [("tool_call", True), ("tool_call", False), ("text_and_tool_call", False), ("reasoning_only", True)]
ECHOES += [("reasoning_only", False)]


@pytest.mark.parametrize("system", [True, False], ids=["client_system", "no_system"])
@pytest.mark.parametrize("content", list(CONTENT))
@pytest.mark.parametrize(("reply", "reasoning"), ECHOES, ids=[f"{r}-{'kept' if k else 'dropped'}" for r, k in ECHOES])
async def test_an_echoed_assistant_message_extends_its_turn(
    proxy: ProxyHarness, reply: str, content: str, system: bool, reasoning: bool
):
    sampled, visible = REPLIES[reply]
    proxy.fake.queue(sampled, ANSWER)
    session = await proxy.create_session([{"role": "user", "content": TASK}], tools=[WEATHER_TOOL])
    messages: list[dict[str, Any]] = [*([SYSTEM] if system else []), {"role": "user", "content": TASK}]
    first = await session.client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER_TOOL])
    message = first.choices[0].message
    assert (message.content or "") == visible
    messages.append(echo(message, content, reasoning=reasoning))
    if message.tool_calls:
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "18C"} for call in message.tool_calls]
    else:
        messages.append({"role": "user", "content": "And now?"})
    second = await session.client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == ANSWER

    path = await proxy.app[keys.STORE].get_path(session.session_id, second.id)
    assert [node.id for node in path] == [first.id, second.id]
    assert path[1].fork is None and "sample_placement" not in path[0].meta
    assert proxy.app[keys.METRICS].value("forks_total", api="chat") == 0
    assert_exact(await proxy.trajectory(second.id), proxy, turns=2)
