"""The Anthropic Messages API through the official ``anthropic`` SDK (async and sync), token for token.

A tool round trip over ``messages.create`` is checked against what the fake engine received and sampled
(every prompt is the trajectory so far; the sampled tokens follow with their logprobs and loss weight 1);
the conversation is attached by content like Chat Completions (thinking dropped from the history extends
its node), and the thinking signature the proxy issues names its node (siblings that differ only in their
reasoning are told apart; a changed block is refused, nothing stored).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import pytest

from rollout_proxy.engines.vllm_http import is_routing_probe
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.anthropic_answers import signed_node, signing_key
from tests.harness import ProxyHarness, store_snapshot

QUESTION = "What's the weather in Paris?"
SYSTEM = "You are a weather assistant."
TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
THINK_AND_CALL = (
    "<think>I need the weather for Paris.</think>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "<think>The tool says sunny.</think>\nIt is sunny in Paris (21C)."
RESULT = '{"sky": "sunny", "celsius": 21}'

one_config = pytest.mark.parametrize(("template_name", "store"), [("qwen3_style", "memory")], indirect=["store"])


def client(proxy: ProxyHarness, api_key: str, **options: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key=api_key, max_retries=0, **options)


def sampled(fake: Any) -> list[Any]:
    """The engine's generations for turns (not its one-token routing probes)."""
    return [generation for generation in fake.generations if not is_routing_probe(generation.payload)]


def assert_exact(trajectory: dict[str, Any], fake: Any, *, turns: int) -> None:
    """The trajectory is what the engine was given and sampled, call by call."""
    total, weights = trajectory["total_token_ids"], trajectory["total_loss_weight"]
    generations = sampled(fake)
    assert len(generations) == turns
    expected = [0.0] * len(total)
    for generation in generations:
        prompt, tokens = generation.prompt, generation.tokens
        assert total[: len(prompt)] == prompt  # nothing the policy sampled was re-tokenized
        assert total[len(prompt) : len(prompt) + len(tokens)] == tokens
        for offset, logprob in enumerate(generation.logprobs):
            expected[len(prompt) + offset] = 1.0
            assert trajectory["total_token_logprobs"][len(prompt) + offset] == pytest.approx(logprob, abs=1e-6)
    assert len(total) == len(generations[-1].prompt) + len(generations[-1].tokens)
    assert weights == expected


def tool_result(call_id: str, content: Any = RESULT) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": content}]}


async def nodes(proxy: ProxyHarness, session_id: str, response_id: str) -> list[Any]:
    path = await proxy.app[keys.STORE].get_path(session_id, response_id)
    assert path
    return path


async def test_a_tool_round_trip_over_create_is_recorded_token_for_token(proxy: ProxyHarness):
    fake = proxy.fake
    fake.queue(THINK_AND_CALL, ANSWER)
    session = await proxy.create_session([{"role": "user", "content": QUESTION}])
    async with client(proxy, session.api_key) as sdk:
        history: list[Any] = [{"role": "user", "content": QUESTION}]
        first = await sdk.messages.create(model="policy", max_tokens=256, system=SYSTEM, messages=history, tools=[TOOL])
        assert [block.type for block in first.content] == ["thinking", "tool_use"]
        thinking, call = first.content
        assert thinking.thinking == "I need the weather for Paris." and thinking.signature
        assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
        assert first.stop_reason == "tool_use" and first.id.startswith("resp_")
        assert first.usage.input_tokens == len(sampled(fake)[0].prompt)
        assert first.usage.output_tokens == len(sampled(fake)[0].tokens)
        assert first.model_extra["token_ids"] == sampled(fake)[0].tokens
        assert first.model_extra["prompt_token_ids"] == sampled(fake)[0].prompt

        history += [{"role": "assistant", "content": first.content}, tool_result(call.id)]
        second = await sdk.messages.create(
            model="policy", max_tokens=256, system=SYSTEM, messages=history, tools=[TOOL]
        )
    assert [block.type for block in second.content] == ["thinking", "text"]
    assert second.content[1].text == "It is sunny in Paris (21C)." and second.stop_reason == "end_turn"

    trajectory = await proxy.trajectory(second.id)
    assert_exact(trajectory, fake, turns=2)
    path = await nodes(proxy, session.session_id, second.id)
    assert [node.api for node in path] == ["messages", "messages"] and path[1].parent_id == first.id
    assert all(node.fork is None for node in path)
    assert [m["role"] for m in trajectory["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory["messages"][0]["content"] == SYSTEM
    assert trajectory["messages"][3] == {"role": "tool", "tool_call_id": call.id, "content": RESULT}
    metrics = proxy.app[keys.METRICS]
    assert metrics.value("turns_total", api="messages") == 2
    assert metrics.value("turn_seconds", api="messages") == 2 and metrics.value("overhead_seconds", api="messages") == 2
    assert metrics.value("requests_total", route="/v1/messages", status="200") == 2


@one_config
async def test_history_without_its_thinking_extends_the_node_it_came_from(proxy: ProxyHarness):
    """Claude Code's ``clear_thinking`` edit, and clients that keep only text and tool calls."""
    fake = proxy.fake
    fake.queue(THINK_AND_CALL, ANSWER, ANSWER)
    session = await proxy.create_session([{"role": "user", "content": QUESTION}])
    async with client(proxy, session.api_key) as sdk:
        first = await sdk.messages.create(
            model="policy", max_tokens=256, messages=[{"role": "user", "content": QUESTION}], tools=[TOOL]
        )
        call = first.content[1]
        echoed = [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]
        history = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": echoed},
            tool_result(call.id),
        ]
        second = await sdk.messages.create(model="policy", max_tokens=256, messages=history, tools=[TOOL])
        # the result as text blocks reads the same as the string
        blocks = [tool_result(call.id, [{"type": "text", "text": RESULT}])]
        third = await sdk.messages.create(model="policy", max_tokens=256, messages=history[:2] + blocks, tools=[TOOL])
    for answer in (second, third):
        path = await nodes(proxy, session.session_id, answer.id)
        assert [node.id for node in path[:-1]] == [first.id] and path[-1].fork is None
    assert sampled(fake)[1].prompt == sampled(fake)[2].prompt


@one_config
async def test_sync_client_with_a_bearer_token_at_the_sessions_base_url_and_count_tokens(proxy: ProxyHarness):
    """``auth_token`` (``Authorization: Bearer``) and the session's ``base_url`` (``…/v1``, so ``/v1/v1/messages``);
    ``count_tokens`` is the length of the prompt the engine then receives."""
    fake = proxy.fake
    fake.queue(ANSWER)
    session = await proxy.create_session([{"role": "user", "content": QUESTION}])
    messages = [{"role": "user", "content": QUESTION}]

    def run() -> tuple[Any, Any]:
        with anthropic.Anthropic(base_url=session.base_url, auth_token=session.api_key, max_retries=0) as sdk:
            count = sdk.messages.count_tokens(model="policy", system=SYSTEM, messages=messages, tools=[TOOL])
            answer = sdk.messages.create(model="policy", max_tokens=256, system=SYSTEM, messages=messages, tools=[TOOL])
            return count, answer

    count, answer = await asyncio.to_thread(run)
    assert session.base_url.endswith("/v1")
    assert count.input_tokens == len(sampled(fake)[0].prompt) == answer.usage.input_tokens
    assert answer.content[-1].text == "It is sunny in Paris (21C)."
    assert len(await proxy.app[keys.STORE].get_nodes(session.session_id) or []) == 1  # counting stored nothing


@one_config
async def test_claude_codes_generation_parameters_are_recorded_when_the_session_ignores_them(proxy: ProxyHarness):
    proxy.fake.queue(ANSWER)
    status, created = await proxy.request(
        "POST",
        "/v1/sessions",
        json={"sample": {}, "generation": {"max_new_tokens": 64}, "client_sampling": "ignore"},
    )
    assert status == 201
    asked = {
        "max_tokens": 128000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
    }
    extra = {
        "temperature": 0.7,  # this SDK no longer takes it as an argument
        "metadata": {"user_id": "someone"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    server_tools = [
        {"type": "web_search_20250305", "name": "web_search"},
        {"name": "DeferredToolPlaceholder", "input_schema": {"type": "object"}, "defer_loading": True},
    ]
    async with (
        client(proxy, created["api_key"]) as sdk,
        sdk.messages.stream(  # 128000 tokens: the SDK streams only
            model="claude-opus-5-5",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[TOOL, *server_tools],
            tool_choice={"type": "any"},
            extra_body=extra,
            extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
            **asked,
        ) as stream,
    ):
        answer = await stream.get_final_message()
    assert answer.model == "claude-opus-5-5"
    (node,) = await proxy.app[keys.STORE].get_nodes(created["session_id"]) or []
    assert node.meta["client_sampling"] == {**asked, "temperature": 0.7}
    assert node.meta["tools_left_out"] == [
        {"type": "web_search_20250305", "name": "web_search"},
        {"type": "deferred", "name": "DeferredToolPlaceholder"},
    ]
    assert node.meta["tool_choice"] == {"type": "any"}
    prompt = proxy.fake.decode(sampled(proxy.fake)[0].prompt)
    assert "get_weather" in prompt and "web_search" not in prompt and "DeferredToolPlaceholder" not in prompt
    assert sampled(proxy.fake)[0].payload["max_tokens"] <= 64  # the session's value was used
    metrics = proxy.app[keys.METRICS]
    assert metrics.value("client_sampling_ignored_total", api="messages", field="max_tokens") == 1
    assert metrics.value("tools_left_out_total", api="messages", type="deferred") == 1


@one_config
async def test_the_thinking_signature_names_its_node_and_a_changed_block_is_refused(proxy: ProxyHarness):
    """Two answers with the same tool call reached by different reasoning: content alone cannot tell them
    apart; the echoed signature names the one this client was answered, and so do the proxy's tool_use ids
    when the thinking is dropped."""
    fake = proxy.fake
    other = THINK_AND_CALL.replace("I need the weather for Paris.", "Paris: look it up.")
    fake.queue(THINK_AND_CALL, other, ANSWER, ANSWER)
    session = await proxy.create_session([{"role": "user", "content": QUESTION}])
    key = signing_key(proxy.app[keys.SETTINGS].token_secret)
    question = [{"role": "user", "content": QUESTION}]
    async with client(proxy, session.api_key) as sdk:
        a = await sdk.messages.create(model="policy", max_tokens=256, messages=question, tools=[TOOL])
        b = await sdk.messages.create(model="policy", max_tokens=256, messages=question, tools=[TOOL])
        assert a.content[1].input == b.content[1].input and a.content[0].thinking != b.content[0].thinking
        assert signed_node(key, a.content[0].signature, a.content[0].thinking) == a.id

        def after(answer: Any, content: list[Any]) -> list[Any]:
            return [*question, {"role": "assistant", "content": content}, tool_result(answer.content[1].id)]

        from_a = await sdk.messages.create(model="policy", max_tokens=256, messages=after(a, a.content), tools=[TOOL])
        unsigned = [a.content[1]]  # without its thinking: its tool_use id names it
        by_call_id = await sdk.messages.create(
            model="policy", max_tokens=256, messages=after(a, unsigned), tools=[TOOL]
        )

        before = await store_snapshot(proxy.app[keys.STORE])
        changed = [
            {"type": "thinking", "thinking": "Something else.", "signature": a.content[0].signature},
            a.content[1],
        ]
        with pytest.raises(anthropic.BadRequestError) as refused:
            await sdk.messages.create(model="policy", max_tokens=256, messages=after(a, changed), tools=[TOOL])
    assert (await nodes(proxy, session.session_id, from_a.id))[-2].id == a.id
    assert (await nodes(proxy, session.session_id, by_call_id.id))[-2].id == a.id
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert refused.value.body["error"]["param"] == "messages[1].content[0].signature"
    assert await store_snapshot(proxy.app[keys.STORE]) == before
    assert len(sampled(fake)) == 4
    assert proxy.app[keys.METRICS].value("parents_by_signature_total", api="messages") == 1
    assert proxy.app[keys.METRICS].value("sibling_parents_total", api="messages", by="tool_call_id") == 1


@one_config
async def test_a_system_message_inside_the_conversation_and_redacted_thinking(proxy: ProxyHarness):
    """Claude Code's shapes: system blocks with cache_control, a ``role: "system"`` turn after the user's (as
    blocks, then as a string: the same message), and a ``redacted_thinking`` block (accepted, not rendered)."""
    fake = proxy.fake
    fake.queue(THINK_AND_CALL, ANSWER)
    session = await proxy.create_session([{"role": "user", "content": QUESTION}])
    system = [
        {"type": "text", "text": "Header."},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]
    reminder = "# Environment\nThe working directory is /tmp."
    history: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "<reminder/>"}, {"type": "text", "text": QUESTION}]},
        {"role": "system", "content": [{"type": "text", "text": reminder}]},
    ]
    async with client(proxy, session.api_key) as sdk:
        first = await sdk.messages.create(model="policy", max_tokens=256, system=system, messages=history, tools=[TOOL])
        content = [{"type": "redacted_thinking", "data": "opaque"}, *[block.model_dump() for block in first.content]]
        history = [history[0], {"role": "system", "content": reminder}, {"role": "assistant", "content": content}]
        history.append(tool_result(first.content[1].id))
        second = await sdk.messages.create(
            model="policy", max_tokens=256, system=system, messages=history, tools=[TOOL]
        )
    trajectory = await proxy.trajectory(second.id)
    assert_exact(trajectory, fake, turns=2)
    assert [m["role"] for m in trajectory["messages"][:3]] == ["system", "user", "system"]
    assert trajectory["messages"][0]["content"] == f"Header.\n{SYSTEM}"
    assert trajectory["messages"][1]["content"] == f"<reminder/>\n{QUESTION}"
    assert "opaque" not in fake.decode(trajectory["total_token_ids"])
    assert (await nodes(proxy, session.session_id, second.id))[0].id == first.id


@one_config
async def test_the_sdks_beta_tool_runner_runs_its_loop_against_a_session(proxy: ProxyHarness):
    """``client.beta.messages.tool_runner``: the SDK calls the tool itself and sends the result back
    (``POST /v1/messages?beta=true`` with ``anthropic-beta``) on a server-held thread: the first request
    ``thread: {"type": "create"}``, the next only the tool result, ``thread: {"type": "continue",
    "previous_message_id"}``, without its system and tools (the thread's)."""
    fake = proxy.fake
    fake.queue(THINK_AND_CALL, ANSWER)
    session = await proxy.create_session([{"role": "user", "content": QUESTION}])
    called: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        called.append(city)
        return RESULT

    def run() -> list[Any]:
        with anthropic.Anthropic(base_url=proxy.url, api_key=session.api_key, max_retries=0) as sdk:
            runner = sdk.beta.messages.tool_runner(
                model="policy",
                max_tokens=256,
                system=SYSTEM,
                messages=[{"role": "user", "content": QUESTION}],
                tools=[get_weather],
                betas=["interleaved-thinking-2025-05-14"],
            )
            return list(runner)

    answers = await asyncio.to_thread(run)
    assert called == ["Paris"]
    assert [answer.stop_reason for answer in answers] == ["tool_use", "end_turn"]
    path = await nodes(proxy, session.session_id, answers[-1].id)
    assert [node.id for node in path] == [answers[0].id, answers[1].id] and path[1].fork is None
    trajectory = await proxy.trajectory(answers[-1].id)
    assert_exact(trajectory, fake, turns=2)
    assert trajectory["messages"][3] == {"role": "tool", "tool_call_id": answers[0].content[1].id, "content": RESULT}
    assert trajectory["messages"][0] == {"role": "system", "content": SYSTEM}
    second_prompt = fake.decode(sampled(fake)[1].prompt)
    assert second_prompt.count("get_weather") == fake.decode(sampled(fake)[0].prompt).count("get_weather") + 1
    assert "thread_tools" in path[0].meta  # the thread's tools: its later turns render with them

    # a thread's system cannot change, and a message it does not know is a 404
    async with client(proxy, session.api_key) as sdk:
        for thread, system, error in (
            ({"type": "continue", "previous_message_id": answers[0].id}, "Another system.", anthropic.BadRequestError),
            ({"type": "continue", "previous_message_id": "resp_nope"}, SYSTEM, anthropic.NotFoundError),
        ):
            with pytest.raises(error) as caught:
                await sdk.messages.create(
                    model="policy",
                    max_tokens=256,
                    system=system,
                    messages=[tool_result(answers[0].content[1].id)],
                    extra_body={"thread": thread},
                )
            assert caught.value.body["error"]["param"] in ("system", "thread.previous_message_id")
