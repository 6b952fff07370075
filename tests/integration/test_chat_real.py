"""Chat Completions through the proxy against a real vLLM: zero drift, token for token."""

from __future__ import annotations

import itertools
import math

import numpy as np

from tests.harness import WEATHER_TOOL, ProxyHarness
from tests.integration.conftest import RecordingRelay, TokenAudit

SYSTEM = "You are a weather assistant. Call get_weather when you need the weather."


def check_turns(relay: RecordingRelay, audit: TokenAudit) -> list[tuple[list[int], list[int], list[float]]]:
    """vLLM's (prompt, output, logprobs) per turn, each prompt extending the previous turn exactly."""
    turns = []
    for request, response in relay.completions:
        choice = response["choices"][0]
        assert request["prompt"] == choice["prompt_token_ids"]  # vLLM consumed exactly what we sent
        assert request["logprobs"] == 0 and request["return_token_ids"] is True
        turns.append((choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    for (prompt, output, _), (next_prompt, _, _) in itertools.pairwise(turns):
        previous = prompt + output
        audit.compare(next_prompt[: len(previous)], previous)
        assert next_prompt[: len(previous)] == previous, "drift: the next prompt does not extend the last turn"
    return turns


def check_trajectory(trajectory: dict, turns, audit: TokenAudit) -> None:
    prompt, output, _ = turns[-1]
    ids = trajectory["total_token_ids"]
    audit.compare(ids, prompt + output)
    assert ids == prompt + output
    weights = np.asarray(trajectory["total_loss_weight"])
    logprobs = trajectory["total_token_logprobs"]
    expected_weights = np.zeros(len(ids))
    for turn_prompt, turn_output, turn_logprobs in turns:
        span = slice(len(turn_prompt), len(turn_prompt) + len(turn_output))
        expected_weights[span] = 1.0
        assert logprobs[span] == turn_logprobs  # the values vLLM reported, exactly
        assert all(math.isfinite(value) and value <= 0.0 for value in turn_logprobs)
    assert np.array_equal(weights, expected_weights)
    assert all(value == 0.0 for value, weight in zip(logprobs, weights, strict=True) if weight == 0)


async def test_four_turn_chat_with_tools_has_zero_drift(
    real_proxy: ProxyHarness, relay: RecordingRelay, audit: TokenAudit
):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What's the weather in Paris?"}]
    session = await real_proxy.create_session(
        messages, tools=[WEATHER_TOOL], max_new_tokens=24, temperature=1.0, top_p=0.95, seed=7
    )
    follow_ups = [
        ("tool", "Paris: 21C, sunny"),
        ("user", "And what about Berlin?"),
        ("tool", "Berlin: 12C, rain"),
        None,
    ]
    last = None
    for index, follow_up in enumerate(follow_ups):
        last = await session.client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER_TOOL])
        message = last.choices[0].message
        messages.append(message.model_dump())
        if follow_up is None:
            break
        role, content = follow_up
        if role == "tool":
            call_id = message.tool_calls[0].id if message.tool_calls else f"call_external_{index}"
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            messages.append({"role": "user", "content": content})
    turns = check_turns(relay, audit)
    assert len(turns) == 4
    check_trajectory(await real_proxy.trajectory(last.id), turns, audit)
    for request, _ in relay.completions:  # every sampling setting is sent explicitly
        assert (request["temperature"], request["top_p"], request["top_k"], request["seed"]) == (1.0, 0.95, -1, 7)
        assert request["max_tokens"] == 24


async def test_responses_three_turns_have_zero_drift(
    real_proxy: ProxyHarness, relay: RecordingRelay, audit: TokenAudit
):
    session = await real_proxy.create_session(
        [{"role": "user", "content": "Name a fruit."}], max_new_tokens=16, temperature=0.8, seed=11
    )
    client = session.client
    first = await client.responses.create(model="smollm2", input=[])
    second = await client.responses.create(model="smollm2", input="Now name a colour.", previous_response_id=first.id)
    third = await client.responses.create(model="smollm2", input="And an animal?", previous_response_id=second.id)
    turns = check_turns(relay, audit)
    assert len(turns) == 3
    check_trajectory(await real_proxy.trajectory(third.id), turns, audit)
    # a fork from the first response extends exactly its tokens too
    fork = await client.responses.create(model="smollm2", input="A vegetable?", previous_response_id=first.id)
    prompt, output, _ = turns[0]
    fork_prompt = relay.completions[-1][1]["choices"][0]["prompt_token_ids"]
    audit.compare(fork_prompt[: len(prompt + output)], prompt + output)
    assert fork_prompt[: len(prompt + output)] == prompt + output
    assert fork.previous_response_id == first.id


async def test_output_cut_by_length_is_closed_before_the_next_turn(
    real_proxy: ProxyHarness, relay: RecordingRelay, audit: TokenAudit
):
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    session = await real_proxy.create_session(messages, max_new_tokens=6, temperature=1.0, seed=3)
    first = await session.client.chat.completions.create(model="smollm2", messages=messages)
    assert first.choices[0].finish_reason == "length"
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Go on."}]
    second = await session.client.chat.completions.create(model="smollm2", messages=messages)
    turns = check_turns(relay, audit)
    end_of_turn = turns[1][0][len(turns[0][0]) + len(turns[0][1])]
    assert end_of_turn == 2  # <|im_end|>, added by the proxy with weight 0
    check_trajectory(await real_proxy.trajectory(second.id), turns, audit)
