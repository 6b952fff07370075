"""The turn's logic on a scripted in-process engine (``tests.scripted_engine``): no socket, no tokenizer.

The properties the one rule rests on, each checked on its own: a root turn's prompt is the whole render
and its generation prompt; a later turn's prompt is the parent's exact tokens and the bridge of the new
messages, never a re-tokenization of what the policy sampled (the engine samples a reply as other ids
than its own tokenizer would give that text); loss weight 1 exactly on sampled tokens; the output parsed
as reasoning when the prompt left a ``<think>`` open; the stream releases the same message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from rollout_proxy.core.rendering import Renderers, RenderingConfig
from rollout_proxy.core.streaming import TurnDelta, TurnDone, TurnStreamer
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turns import TurnRunner
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.sampling import Sampled
from rollout_proxy.errors import EngineError
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import PolicySpan
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.tokenization.parsers import OutputParser
from tests.core.builders import session_record
from tests.scripted_engine import END, Scripted, ScriptedEngine

QUESTION = {"role": "user", "content": "What is the weather?"}


@dataclass
class Rig:
    engine: ScriptedEngine
    store: MemoryStore
    metrics: Metrics
    runner: TurnRunner
    tree: ResponseTree


async def rig_with(engine: ScriptedEngine) -> AsyncIterator[Rig]:
    store, metrics = MemoryStore(), Metrics()
    fleet = Fleet([engine], metrics=metrics)
    await fleet.start()
    renderers = Renderers(RenderingConfig(), metrics=metrics)  # the server's defaults: no local tokenizer here
    runner = TurnRunner(
        store=store, engines=fleet, parser=OutputParser.named("hermes", "think"), metrics=metrics, renderers=renderers
    )
    try:
        yield Rig(engine, store, metrics, runner, ResponseTree(store=store, metrics=metrics))
    finally:
        await fleet.close()
        await store.close()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async for made in rig_with(ScriptedEngine()):
        yield made


async def turn(rig: Rig, session, messages):
    placement = await rig.tree.locate(session, messages, api="chat")
    return await rig.runner.generate(session, placement, api="chat", tools=None)


async def test_a_root_turn_sends_the_whole_render_and_records_what_was_sampled(rig: Rig):
    session = session_record(engine=rig.engine.url)
    await rig.store.create_session(session)
    rig.engine.queue("Sunny.")
    result = await turn(rig, session, [QUESTION])
    ((prompt, _),) = rig.engine.calls
    assert prompt == rig.engine.encode(rig.engine.render([QUESTION], add_generation_prompt=True))
    assert result.node.output_ids.tolist() == rig.engine.sampled[0] and rig.engine.sampled[0][-1] == 2
    assert result.node.messages[-1] == {"role": "assistant", "content": "Sunny."}
    trajectory = assemble(session.id, [result.node])
    assert trajectory.total_token_ids.tolist() == prompt + rig.engine.sampled[0]
    assert trajectory.total_loss_weight.tolist() == [0.0] * len(prompt) + [1.0] * len(rig.engine.sampled[0])


async def test_a_later_turn_extends_the_sampled_ids_and_never_re_tokenizes_them(rig: Rig):
    session = session_record(engine=rig.engine.url)
    await rig.store.create_session(session)
    rig.engine.queue(Scripted("It is sunny today.", split=True), "Bring sunglasses.")
    first = await turn(rig, session, [QUESTION])
    sampled = rig.engine.sampled[0]
    assert sampled[:-1] != rig.engine.encode("It is sunny today.")  # other ids than its own tokenizer's
    follow_up = {"role": "user", "content": "And tomorrow?"}
    second = await turn(rig, session, [QUESTION, first.node.messages[-1], follow_up])
    assert second.node.parent_id == first.node.id
    (first_prompt, _), (second_prompt, _) = rig.engine.calls
    head = first_prompt + sampled
    assert second_prompt[: len(head)] == head  # the parent's exact tokens
    bridge = second_prompt[len(head) :]
    assert rig.engine.decode(bridge) == f"\n<|im_start|>user\nAnd tomorrow?{END}\n<|im_start|>assistant\n"
    assert second.node.prompt_ids.tolist() == bridge
    trajectory = assemble(session.id, [first.node, second.node])
    weights = trajectory.total_loss_weight
    trained = np.flatnonzero(weights).tolist()
    assert [int(trajectory.total_token_ids[i]) for i in trained] == sampled + rig.engine.sampled[1]


async def test_a_prompt_that_opens_think_makes_the_reply_reasoning_first():
    async for rig in rig_with(ScriptedEngine(generation_prompt_suffix="<think>\n")):
        session = session_record(engine=rig.engine.url)
        await rig.store.create_session(session)
        rig.engine.queue("Look it up.</think>\n\nSunny.")
        result = await turn(rig, session, [QUESTION])
        assert result.node.messages[-1] == {
            "role": "assistant",
            "content": "Sunny.",
            "reasoning_content": "Look it up.",
        }


async def test_the_streamed_turn_releases_the_message_it_records(rig: Rig):
    session = session_record(engine=rig.engine.url)
    await rig.store.create_session(session)
    rig.engine.queue("Clouds, then sun.")
    placement = await rig.tree.locate(session, [QUESTION], api="chat")
    content, done = "", None
    async for event in TurnStreamer(rig.runner).stream(session, placement, api="chat", tools=None):
        if isinstance(event, TurnDelta):
            content += event.view.content
        elif isinstance(event, TurnDone):
            done = event
    assert done is not None and content == done.result.node.messages[-1]["content"] == "Clouds, then sun."
    assert done.result.node.output_ids.tolist() == rig.engine.sampled[0]


async def test_deltas_the_engine_sent_together_say_another_follows(rig: Rig):
    """The scripted engine hands over every token before the stream reads one: each delta but the last says
    another is ready (a writer sends them in one write); the last says none is, so it is not held back."""
    session = session_record(engine=rig.engine.url)
    await rig.store.create_session(session)
    rig.engine.queue("Clouds, then sun.")
    placement = await rig.tree.locate(session, [QUESTION], api="chat")
    stream = TurnStreamer(rig.runner).stream(session, placement, api="chat", tools=None)
    deltas = [event async for event in stream if isinstance(event, TurnDelta) and len(event.token_ids)]
    assert len(deltas) > 2
    assert [delta.more for delta in deltas] == [True] * (len(deltas) - 1) + [False]


async def test_an_engine_that_does_not_echo_the_prompt_is_refused():
    async for rig in rig_with(ScriptedEngine(echo=False)):
        session = session_record(engine=rig.engine.url)
        await rig.store.create_session(session)
        with pytest.raises(EngineError, match="drift check cannot run"):
            await turn(rig, session, [QUESTION])
        assert await rig.store.latest(session.id, "*") is None


class OpenGate:
    paused = False

    async def wait(self, *, queued: bool = True) -> None:
        return None


@dataclass
class OneEngine:
    """An ``EngineRouter`` that is not the fleet: one engine, no health, no failover, a fixed version."""

    engine: ScriptedEngine
    gate: OpenGate = field(default_factory=OpenGate)
    retries: int = 0

    def route(self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()) -> ScriptedEngine:
        return self.engine

    async def route_now(
        self, sticky: str | None, *, exclude: frozenset[str] | set[str] = frozenset()
    ) -> ScriptedEngine:
        return self.engine

    def pick(self) -> ScriptedEngine:
        return self.engine

    def report_failure(self, engine: object, error: BaseException, *, what: str = "call") -> None:
        raise AssertionError(f"no step fails here: {error}")

    def check_policy(self, policy: str) -> None:
        assert policy == "base"

    async def sample(
        self, engine: ScriptedEngine, prompt: np.ndarray, params: SamplingParams, *, sink=None, policy=None
    ) -> Sampled:
        completion = await engine.complete(prompt, params, sink=sink)
        return Sampled(completion, engine, (PolicySpan(7, 0, len(completion.output_ids)),))


async def test_a_turn_sees_the_engines_only_through_the_router_protocol():
    """The core takes any ``EngineRouter``: a stand-in that is no fleet drives a whole turn, and the node
    records the versions its ``sample`` said."""
    engine, store, metrics = ScriptedEngine(), MemoryStore(), Metrics()
    runner = TurnRunner(
        store=store,
        engines=OneEngine(engine),
        parser=OutputParser.named("hermes", "think"),
        metrics=metrics,
        renderers=Renderers(RenderingConfig(), metrics=metrics),
    )
    session = session_record(engine=engine.url)
    await store.create_session(session)
    engine.queue("Sunny.")
    placement = await ResponseTree(store=store, metrics=metrics).locate(session, [QUESTION], api="chat")
    result = await runner.generate(session, placement, api="chat", tools=None)
    assert result.node.messages[-1] == {"role": "assistant", "content": "Sunny."}
    assert result.node.policy_versions == (PolicySpan(7, 0, len(result.node.output_ids)),)
    await store.close()
