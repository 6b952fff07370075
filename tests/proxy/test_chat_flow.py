"""A 4-turn tool-calling conversation through the proxy with the official openai SDK.

Runs over both stores and both chat templates (Qwen3-style, which strips earlier
<think> blocks; SmolLM2's own, which injects a default system prompt).
"""

from __future__ import annotations

import json

import numpy as np

from tests.harness import WEATHER_TOOL, ProxyHarness

PARIS = "Paris: 21C, sunny"
BERLIN = "Berlin: 12C, rain"
ROME = "Rome: 25C, clear"

REPLIES = [
    "<think>I need the weather for both cities.</think>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "C"}}\n</tool_call>',
    "<think>Paris is sunny, Berlin is rainy.</think>\nParis is sunny (21C) and Berlin is rainy (12C).",
    '<think>Now Rome.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "<think>Rome is warm.</think>\nRome is clear and warm at 25C.",
]

#: What the templates must render between turns (after the previous turn's <|im_end|>).
EXPECTED_BRIDGES = {
    "qwen3_style": [
        f"\n<|im_start|>user\n<tool_response>\n{PARIS}\n</tool_response>\n<tool_response>\n{BERLIN}\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n",
        f"\n<|im_start|>user\n<tool_response>\n{ROME}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ],
    "smollm2_default": [
        f"\n<|im_start|>tool\n{PARIS}<|im_end|>\n<|im_start|>tool\n{BERLIN}<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n",
        f"\n<|im_start|>tool\n{ROME}<|im_end|>\n<|im_start|>assistant\n",
    ],
}


async def run_conversation(proxy: ProxyHarness):
    fake = proxy.fake
    fake.queue(*REPLIES)
    messages = [{"role": "user", "content": "What's the weather in Paris and Berlin?"}]
    session = await proxy.create_session(messages, tools=[WEATHER_TOOL])
    client = session.client
    completions = []

    # turn 1: two tool calls; echoed back as the SDK dumps it (null fields, reasoning kept)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER_TOOL])
    completions.append(first)
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls
    assert [json.loads(call.function.arguments) for call in calls] == [
        {"city": "Paris"},
        {"city": "Berlin", "unit": "C"},
    ]
    assert first.choices[0].message.model_extra["reasoning_content"] == "I need the weather for both cities."
    messages.append(first.choices[0].message.model_dump())
    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": PARIS})
    messages.append({"role": "tool", "tool_call_id": calls[1].id, "content": BERLIN})

    # turn 2: text answer; echoed as text parts, without its reasoning
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER_TOOL])
    completions.append(second)
    assert second.choices[0].message.content == "Paris is sunny (21C) and Berlin is rainy (12C)."
    messages.append({"role": "assistant", "content": [{"type": "text", "text": second.choices[0].message.content}]})
    messages.append({"role": "user", "content": "And in Rome?"})

    # turn 3: one tool call; echoed with re-serialized arguments and no reasoning
    third = await client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER_TOOL])
    completions.append(third)
    call = third.choices[0].message.tool_calls[0]
    echoed_call = {
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.function.name,
            "arguments": json.dumps(json.loads(call.function.arguments), indent=2),
        },
    }
    messages.append({"role": "assistant", "content": None, "tool_calls": [echoed_call]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": ROME})

    # turn 4: final answer
    fourth = await client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER_TOOL])
    completions.append(fourth)
    assert fourth.choices[0].finish_reason == "stop"
    return session, completions


async def test_four_turn_conversation_is_token_exact(proxy: ProxyHarness, template_name: str):
    _session, completions = await run_conversation(proxy)
    fake = proxy.fake
    prompts = fake.prompts
    assert len(prompts) == 4
    outputs = [completion.choices[0].model_extra["token_ids"] for completion in completions]

    for turn in range(1, 4):
        previous = prompts[turn - 1] + outputs[turn - 1]
        # zero drift: the engine's new prompt starts with exactly what it saw and sampled
        assert prompts[turn][: len(previous)] == previous
        bridge = prompts[turn][len(previous) :]
        assert fake.decode(bridge) == EXPECTED_BRIDGES[template_name][turn - 1]
    for completion, prompt in zip(completions, prompts, strict=True):
        assert completion.model_extra["prompt_token_ids"] == prompt

    trajectory = await proxy.trajectory(completions[-1].id)
    ids = trajectory["total_token_ids"]
    assert ids == prompts[-1] + outputs[-1]
    assert trajectory["turns"] == 4 and trajectory["forks"] == []

    weights = np.asarray(trajectory["total_loss_weight"])
    logprobs = np.asarray(trajectory["total_token_logprobs"])
    expected_weights = np.zeros(len(ids))
    for prompt, output in zip(prompts, outputs, strict=True):
        expected_weights[len(prompt) : len(prompt) + len(output)] = 1.0
    assert np.array_equal(weights, expected_weights)
    assert np.all(logprobs[weights == 0] == 0.0)
    from devtools.fake_engine import fake_logprob

    for prompt, output in zip(prompts, outputs, strict=True):
        engine_logprobs = [fake_logprob(len(prompt) + i, token) for i, token in enumerate(output)]
        assert logprobs[len(prompt) : len(prompt) + len(output)].tolist() == [
            float(np.float32(value)) for value in engine_logprobs
        ]

    # generated <think> blocks are kept as sampled, even where the template strips them
    text = fake.decode(ids)
    for reply in REPLIES:
        assert reply.split("</think>")[0] in text
    assert trajectory["usage"]["completion_tokens"] == sum(len(output) for output in outputs)
    assert trajectory["usage"]["total_tokens"] == len(ids)
    assert [message["role"] for message in trajectory["messages"]] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


async def test_default_system_prompt_is_rendered_once(proxy: ProxyHarness, template_name: str):
    _session, completions = await run_conversation(proxy)
    text = proxy.fake.decode((await proxy.trajectory(completions[-1].id))["total_token_ids"])
    expected = 1 if template_name == "smollm2_default" else 0
    assert text.count("You are a helpful AI assistant named SmolLM") == expected


async def test_session_trajectory_is_the_latest_chat_completion(proxy: ProxyHarness):
    session, completions = await run_conversation(proxy)
    status, latest = await proxy.request("GET", f"/v1/sessions/{session.session_id}/trajectory")
    assert status == 200
    assert latest["response_id"] == completions[-1].id
    # the plugin's own token reads its session too
    status, own = await proxy.request("GET", f"/v1/sessions/{session.session_id}/trajectory", token=session.api_key)
    assert status == 200 and own["total_token_ids"] == latest["total_token_ids"]
