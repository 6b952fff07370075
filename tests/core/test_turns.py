"""TurnRunner against the fake engine: exact prompts, recorded samples, and what stops a turn."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from devtools.fake_engine import fake_logprob
from rollout_proxy.core.rendering import Renderers, RenderingConfig
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turns import TurnRunner, path_tokens
from rollout_proxy.engines.base import EngineCompletion, EngineInfo, SamplingParams
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import ContextLengthExceeded, EngineError, SessionNotFound
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import GenerationConfig, NodeKind
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.tokenization.parsers import OutputParser
from tests.core.builders import session_record

QUESTION = {"role": "user", "content": "What is 2+2?"}
FOLLOW_UP = {"role": "user", "content": "And 3+3?"}


async def open_session(turns, **kwargs: Any):
    session = session_record(engine=turns.engine.url, now=turns.clock.now, **kwargs)
    await turns.store.create_session(session)
    return session


def split_into_characters(fake, text: str) -> list[int]:
    """Token ids for ``text`` that a re-tokenization of the text would never produce."""
    ids = [token for char in text for token in fake.encode(char)]
    assert ids != fake.encode(text)
    return ids


def decoded(fake, ids: Sequence[int]) -> str:
    return fake.decode([int(token) for token in ids])


async def test_first_turn_prompt_is_the_rendered_conversation(turns):
    session = await open_session(turns)
    placement = await turns.tree.locate(session, [QUESTION], api="chat")
    result = await turns.runner.generate(session, placement, api="chat", tools=None)
    expected = turns.fake.encode(turns.fake.render([QUESTION], add_generation_prompt=True))
    assert turns.fake.prompts == [expected]
    assert result.prompt_ids.tolist() == expected
    assert result.node.prompt_ids.tolist() == expected  # the root node holds the whole prompt
    assert result.node.parent_id is None


async def test_next_prompt_is_the_parents_exact_tokens_plus_the_bridge(turns):
    fake = turns.fake
    session = await open_session(turns)
    sampled = split_into_characters(fake, "Four")
    fake.queue(sampled)
    first = await turns.runner.generate(
        session, await turns.tree.locate(session, [QUESTION], api="chat"), api="chat", tools=None
    )
    assert first.node.output_ids.tolist() == [*sampled, fake.eos_id]

    conversation = [QUESTION, first.view.message(), FOLLOW_UP]
    placement = await turns.tree.locate(session, conversation, api="chat")
    assert placement.parent_id == first.node.id
    second = await turns.runner.generate(session, placement, api="chat", tools=None)

    parent_tokens = [*first.node.prompt_ids.tolist(), *first.node.output_ids.tolist()]
    delta = second.node.prompt_ids.tolist()
    assert fake.prompts[-1] == [*parent_tokens, *delta] == second.prompt_ids.tolist()
    assert decoded(fake, delta) == "\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    # the point of it: a re-render of the conversation would have re-tokenized the answer
    assert fake.prompts[-1] != fake.encode(fake.render(conversation, add_generation_prompt=True))
    assert path_tokens([first.node, second.node]).tolist() == [*parent_tokens, *delta, *second.node.output_ids]


async def test_the_node_records_what_the_engine_sampled(turns):
    fake = turns.fake
    session = await open_session(turns)
    fake.queue("The answer is 4.")
    result = await turns.runner.generate(
        session, await turns.tree.locate(session, [QUESTION], api="chat"), api="chat", tools=None
    )
    node = result.node
    sampled = [*fake.encode("The answer is 4."), fake.eos_id]
    prompt_len = len(fake.prompts[0])
    assert node.output_ids.tolist() == sampled
    expected_logprobs = np.asarray([fake_logprob(prompt_len + i, t) for i, t in enumerate(sampled)], dtype=np.float32)
    assert np.array_equal(node.output_logprobs, expected_logprobs)
    assert node.kind is NodeKind.GENERATED and node.finish_reason == "stop"
    assert node.messages == [QUESTION, {"role": "assistant", "content": "The answer is 4."}]
    assert node.n_input_messages == 1 and node.model == fake.model_name
    assert node.usage == {
        "prompt_tokens": prompt_len,
        "completion_tokens": len(sampled),
        "total_tokens": prompt_len + len(sampled),
    }
    stored = await turns.store.get_path(session.id, node.id)
    assert [n.id for n in stored] == [node.id]
    assert np.array_equal(stored[-1].output_ids, node.output_ids)
    assert await turns.store.latest(session.id, "chat") == node.id
    assert turns.metrics.value("turns_total", api="chat") == 1
    assert turns.metrics.value("generated_tokens_total") == len(sampled)


async def test_sampling_settings_come_from_the_session(turns):
    generation = GenerationConfig(max_new_tokens=7, temperature=0.6, top_p=0.8, top_k=20, seed=11)
    session = await open_session(turns, generation=generation)
    placement = await turns.tree.locate(session, [QUESTION], api="chat")
    await turns.runner.generate(session, placement, api="chat", tools=None, stop=["\n\n"])
    payload = turns.fake.completions[-1]
    assert (payload["max_tokens"], payload["temperature"], payload["top_p"], payload["top_k"]) == (7, 0.6, 0.8, 20)
    assert payload["seed"] == 11 and payload["stop"] == ["\n\n"]


async def test_max_tokens_is_cut_to_the_room_left(turns):
    fake = turns.fake
    fake.max_model_len = len(fake.encode(fake.render([QUESTION], add_generation_prompt=True))) + 3
    session = await open_session(turns, generation=GenerationConfig(max_new_tokens=100))
    fake.queue("one two three four five six")
    placement = await turns.tree.locate(session, [QUESTION], api="chat")
    result = await turns.runner.generate(session, placement, api="chat", tools=None)
    assert fake.completions[-1]["max_tokens"] == 3
    assert result.node.finish_reason == "length" and len(result.node.output_ids) == 3


async def test_a_context_without_room_is_refused_and_nothing_is_stored(turns):
    turns.fake.max_model_len = 8
    session = await open_session(turns)
    placement = await turns.tree.locate(session, [QUESTION], api="chat")
    with pytest.raises(ContextLengthExceeded) as raised:
        await turns.runner.generate(session, placement, api="chat", tools=None)
    assert raised.value.param == "messages"
    assert turns.fake.completions == []
    assert await turns.store.latest(session.id, "*") is None
    assert await turns.store.match_paths(session.id, placement.new_hashes) == [None]


class DriftingEngine:
    """An engine that reports having consumed a prompt one token shorter than it was sent."""

    returns_routing = None

    def __init__(self, inner: VLLMEngine, *, echo: bool = True) -> None:
        self._echo = echo
        self.url = inner.url
        self._inner = inner

    async def info(self) -> EngineInfo:
        return await self._inner.info()

    async def tokenize_messages(self, messages, *, tools, add_generation_prompt, chat_template_kwargs) -> np.ndarray:
        return await self._inner.tokenize_messages(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    async def tokenize_text(self, text: str) -> np.ndarray:
        return await self._inner.tokenize_text(text)

    async def complete(self, prompt_ids: np.ndarray, params: SamplingParams, *, on_sent=None) -> EngineCompletion:
        completion = await self._inner.complete(prompt_ids, params, on_sent=on_sent)
        completion.prompt_ids = completion.prompt_ids[1:] if self._echo else None
        return completion

    def __getattr__(self, name: str):  # the rest of the engine (health, control) as the real one
        return getattr(self._inner, name)


async def test_prompt_drift_is_an_engine_error_and_counted(fake_engine):
    store, metrics = MemoryStore(), Metrics()
    engine = DriftingEngine(VLLMEngine(fake_engine.url))
    fleet = Fleet([engine], metrics=metrics)
    await fleet.start()
    runner = TurnRunner(
        store=store,
        engines=fleet,
        parser=OutputParser.named("hermes", "think"),
        metrics=metrics,
        renderers=Renderers(RenderingConfig(), metrics=metrics),
    )
    session = session_record(engine=engine.url)
    await store.create_session(session)
    placement = await ResponseTree(store=store, metrics=metrics).locate(session, [QUESTION], api="chat")
    try:
        with pytest.raises(EngineError):
            await runner.generate(session, placement, api="chat", tools=None)
    finally:
        await fleet.close()
    assert metrics.value("prompt_drift_total") == 1
    assert await store.latest(session.id, "*") is None


@pytest.mark.parametrize("require", [True, False])
async def test_an_answer_without_the_prompt_echo_is_refused_or_recorded_unchecked(fake_engine, require):
    """The drift check never switches itself off: a missing echo is an error by default, and with
    ``--prompt-echo count`` the turn is recorded flagged; either way it is counted."""
    store, metrics = MemoryStore(), Metrics()
    engine = DriftingEngine(VLLMEngine(fake_engine.url), echo=False)
    fleet = Fleet([engine], metrics=metrics)
    await fleet.start()
    parser = OutputParser.named("hermes", "think")
    renderers = Renderers(RenderingConfig(), metrics=metrics)
    runner = TurnRunner(
        store=store, engines=fleet, parser=parser, metrics=metrics, renderers=renderers, require_prompt_echo=require
    )
    session = session_record(engine=engine.url)
    await store.create_session(session)
    placement = await ResponseTree(store=store, metrics=metrics).locate(session, [QUESTION], api="chat")
    try:
        if require:
            with pytest.raises(EngineError, match="drift check cannot run"):
                await runner.generate(session, placement, api="chat", tools=None)
            assert await store.latest(session.id, "*") is None
        else:
            result = await runner.generate(session, placement, api="chat", tools=None)
            assert result.node.meta["prompt_unchecked"] is True
            assert await store.latest(session.id, "*") == result.node.id
    finally:
        await fleet.close()
    assert metrics.value("unchecked_prompts_total") == 1
    assert metrics.value("prompt_drift_total") == 0


async def test_a_tool_call_finishes_with_tool_calls(turns):
    session = await open_session(turns)
    turns.fake.queue('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    placement = await turns.tree.locate(session, [QUESTION], api="chat")
    result = await turns.runner.generate(session, placement, api="chat", tools=None)
    assert result.node.finish_reason == "tool_calls"
    (call,) = result.node.messages[-1]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert result.node.messages[-1]["content"] is None
    assert turns.metrics.value("tool_parse_total", outcome="calls") == 1


async def test_a_turn_cut_by_length_is_closed_by_the_next_bridge(turns):
    fake = turns.fake
    session = await open_session(turns, generation=GenerationConfig(max_new_tokens=2))
    fake.queue("a rather long answer that does not fit")
    first = await turns.runner.generate(
        session, await turns.tree.locate(session, [QUESTION], api="chat"), api="chat", tools=None
    )
    assert first.node.finish_reason == "length" and first.node.output_ids[-1] != fake.eos_id
    placement = await turns.tree.after(session, first.node.id, [FOLLOW_UP])
    second = await turns.runner.generate(session, placement, api="chat", tools=None)
    end_of_turn = fake.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert second.node.prompt_ids[0] == end_of_turn
    assert decoded(fake, second.node.prompt_ids[1:]).startswith("\n<|im_start|>user\nAnd 3+3?")


async def test_inject_stores_a_closed_weight_zero_node(turns):
    fake = turns.fake
    session = await open_session(turns)
    first = await turns.runner.generate(
        session, await turns.tree.locate(session, [QUESTION], api="chat"), api="chat", tools=None
    )
    note = {"role": "user", "content": "A note from the environment."}
    injected = await turns.runner.inject(
        session, await turns.tree.after(session, first.node.id, [note]), api="messages"
    )
    assert injected.kind is NodeKind.INJECTED and injected.parent_id == first.node.id
    assert injected.messages == [note] and injected.n_input_messages == 1
    assert len(injected.output_ids) == 0 and injected.finish_reason is None
    assert decoded(fake, injected.prompt_ids) == "\n<|im_start|>user\nA note from the environment.<|im_end|>"
    assert await turns.store.latest(session.id, "messages") == injected.id
    assert turns.metrics.value("injected_nodes_total") == 1

    # the next turn follows the closed node without closing it again
    third = await turns.runner.generate(
        session, await turns.tree.after(session, injected.id, []), api="chat", tools=None
    )
    assert decoded(fake, third.node.prompt_ids) == "\n<|im_start|>assistant\n"
    path = await turns.store.get_path(session.id, third.node.id)
    trajectory = assemble(session.id, path)
    weights = trajectory.total_loss_weight
    expected = np.concatenate(
        [
            np.zeros(len(first.node.prompt_ids)),
            np.ones(len(first.node.output_ids)),
            np.zeros(len(injected.prompt_ids) + len(third.node.prompt_ids)),
            np.ones(len(third.node.output_ids)),
        ]
    )
    assert np.array_equal(weights, expected)
    assert trajectory.total_token_ids.tolist() == fake.prompts[-1] + third.node.output_ids.tolist()


async def test_inject_at_the_root_ends_at_the_last_turn(turns):
    session = await open_session(turns)
    messages = [QUESTION, {"role": "assistant", "content": "4, says another model."}]
    node = await turns.runner.inject(
        session, await turns.tree.locate(session, messages, api="messages"), api="messages"
    )
    rendered = turns.fake.encode(turns.fake.render(messages, add_generation_prompt=False))
    assert rendered[-1] != node.prompt_ids[-1]  # the template's trailing newline belongs to the next bridge
    assert node.prompt_ids.tolist() == rendered[:-1]
    assert decoded(turns.fake, node.prompt_ids[-1:]) == "<|im_end|>"


async def test_writes_to_an_unknown_or_expired_session_are_refused(turns):
    unknown = session_record(engine=turns.engine.url)  # never created
    with pytest.raises(SessionNotFound):
        await turns.runner.generate(
            unknown, await turns.tree.locate(unknown, [QUESTION], api="chat"), api="chat", tools=None
        )
    with pytest.raises(SessionNotFound):
        await turns.runner.inject(unknown, await turns.tree.locate(unknown, [QUESTION], api="messages"), api="messages")

    expiring = await open_session(turns, ttl=30)
    placement = await turns.tree.locate(expiring, [QUESTION], api="chat")
    turns.clock.now += 31
    with pytest.raises(SessionNotFound):
        await turns.runner.generate(expiring, placement, api="chat", tools=None)


async def test_a_sessions_request_bound_limits_calls_in_flight(turns):
    """Sessions sharing a concurrency key (a job's request_concurrency) share one bound."""
    turns.fake.delay = 0.2
    bound = {"key": "job-1", "max_requests": 2}
    sessions = [await open_session(turns, concurrency=bound) for _ in range(5)]
    placements = [await turns.tree.locate(session, [QUESTION], api="chat") for session in sessions]
    await asyncio.gather(
        *(
            turns.runner.generate(session, placement, api="chat", tools=None)
            for session, placement in zip(sessions, placements, strict=True)
        )
    )
    assert len(turns.fake.completions) == 5
    assert turns.fake.max_inflight == 2
