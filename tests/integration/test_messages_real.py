"""The Anthropic Messages API through the proxy against a real vLLM: a tool round trip, zero drift."""

from __future__ import annotations

from typing import Any

import anthropic

from tests.harness import ProxyHarness
from tests.integration.conftest import RecordingRelay, TokenAudit
from tests.integration.test_chat_real import SYSTEM, check_trajectory, check_turns

TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def test_a_messages_tool_round_trip_has_zero_drift(
    real_proxy: ProxyHarness, relay: RecordingRelay, audit: TokenAudit
):
    """Three turns (the question, the tool's result, a follow-up): every prompt vLLM consumed extends the
    previous turn exactly and the trajectory is what vLLM sampled (streaming against vLLM is
    test_streaming_real's: the recording relay reads whole JSON answers)."""
    question = [{"role": "user", "content": "What's the weather in Paris?"}]
    session = await real_proxy.create_session(question, max_new_tokens=24, temperature=1.0, top_p=0.95, seed=7)
    root = real_proxy.url
    history: list[dict[str, Any]] = list(question)
    async with anthropic.AsyncAnthropic(base_url=root, api_key=session.api_key, max_retries=0) as sdk:
        first = await sdk.messages.create(model="smollm2", max_tokens=24, system=SYSTEM, messages=history, tools=[TOOL])
        history.append({"role": "assistant", "content": first.content})
        calls = [block.id for block in first.content if block.type == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": calls[0] if calls else "call_external", "content": "21C, sunny"}
        history.append({"role": "user", "content": [result]})
        second = await sdk.messages.create(
            model="smollm2", max_tokens=24, system=SYSTEM, messages=history, tools=[TOOL]
        )
        history += [{"role": "assistant", "content": second.content}, {"role": "user", "content": "And Berlin?"}]
        last = await sdk.messages.create(model="smollm2", max_tokens=24, system=SYSTEM, messages=history, tools=[TOOL])
    turns = check_turns(relay, audit)
    assert len(turns) == 3
    check_trajectory(await real_proxy.trajectory(last.id), turns, audit)
    for message, (prompt, output, _) in zip((first, second, last), turns, strict=True):
        assert message.usage.input_tokens == len(prompt) and message.usage.output_tokens == len(output)
    assert second.model_extra["token_ids"] == turns[1][1]
    assert all(request["max_tokens"] == 24 for request, _ in relay.completions)


async def test_a_turn_ended_by_a_stop_sequence_says_which_and_the_next_turn_extends_it(
    real_proxy: ProxyHarness, relay: RecordingRelay, audit: TokenAudit
):
    """vLLM reports the stop string that ended a completion (``stop_reason``): the message says
    ``stop_sequence`` and which one; the tokens are vLLM's (the turn is not closed by an end-of-turn token,
    so the next turn's bridge closes it) and the next prompt extends them exactly."""
    question = [{"role": "user", "content": "Describe the weather in Paris in two sentences."}]
    session = await real_proxy.create_session(question, max_new_tokens=24, temperature=1.0, top_p=0.95, seed=7)
    async with anthropic.AsyncAnthropic(base_url=real_proxy.url, api_key=session.api_key, max_retries=0) as sdk:
        first = await sdk.messages.create(model="smollm2", max_tokens=24, messages=question, stop_sequences=[" "])
        history = [*question, {"role": "assistant", "content": first.content or "…"}]
        history.append({"role": "user", "content": "Go on."})
        last = await sdk.messages.create(model="smollm2", max_tokens=24, messages=history)
    (request, response), _ = relay.completions
    assert request["stop"] == [" "]
    assert response["choices"][0]["stop_reason"] == " " and response["choices"][0]["finish_reason"] == "stop"
    assert (first.stop_reason, first.stop_sequence) == ("stop_sequence", " ")
    turns = check_turns(relay, audit)
    check_trajectory(await real_proxy.trajectory(last.id), turns, audit)
