"""Turns over a fleet of fake engines: a session follows the engine its turn ended on, rendering fails
over too, a paused fleet holds a new turn before it touches an engine, and the trajectory says
which policy version sampled every generated token."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_proxy.core.rendering import Renderers, RenderingConfig
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turns import TurnRunner
from rollout_proxy.engines import control
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.ids import new_response_id, new_session_id
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import NodeKind, PolicySpan, ResponseNode
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.tokenization.parsers import OutputParser
from tests.core.builders import session_record
from tests.fakes import FakeFleet, fake_fleet

QUESTION = {"role": "user", "content": "What is 2+2?"}
FOLLOW_UP = {"role": "user", "content": "And 3+3?"}


@pytest.fixture
async def fakes(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 2) as fleet:
        yield fleet


@pytest.fixture
async def world(fakes: FakeFleet):
    store, metrics = MemoryStore(), Metrics()
    fleet = Fleet([VLLMEngine(url, bound_completions=False) for url in fakes.urls], FleetSettings(probe_interval=60.0))
    await fleet.start()
    runner = TurnRunner(
        store=store,
        engines=fleet,
        parser=OutputParser.named("hermes", "think"),
        metrics=metrics,
        renderers=Renderers(RenderingConfig(), metrics=metrics),
    )
    yield store, fleet, runner, ResponseTree(store=store, metrics=metrics), metrics
    await fleet.close()


async def test_a_session_whose_engine_died_moves_and_its_later_turns_follow(world, fakes: FakeFleet):
    store, fleet, runner, tree, metrics = world
    session = session_record(engine=fakes.urls[0])
    await store.create_session(session)
    await fakes.kill(0)
    first = await runner.generate(session, await tree.locate(session, [QUESTION], api="chat"), api="chat", tools=None)
    assert (await store.get_session(session.id)).engine == fakes.urls[1]
    assert metrics.value("engine_failovers_total") == 1
    await fakes.restart(0)
    await fleet.probe(fleet.members[fakes.urls[0]])  # healthy again: the session stays where it went
    again = await store.get_session(session.id)
    await runner.generate(again, await tree.after(again, first.node.id, [FOLLOW_UP]), api="chat", tools=None)
    assert len(fakes.engines[1].completions) == 2 and fakes.engines[0].completions == []


async def test_a_paused_fleet_holds_a_new_turn_before_it_touches_an_engine(world, fakes: FakeFleet):
    store, fleet, runner, tree, _ = world
    session = session_record(engine=fakes.urls[0])
    await store.create_session(session)
    placement = await tree.locate(session, [QUESTION], api="chat")
    await control.pause(fleet, "abort")
    turn = asyncio.create_task(runner.generate(session, placement, api="chat", tools=None))
    await asyncio.sleep(0.2)
    assert not turn.done() and all(engine.completions == [] for engine in fakes.engines)
    await control.resume(fleet, 3)
    result = await turn
    assert result.node.policy_versions == (PolicySpan(3, 0, len(result.node.output_ids)),)
    stored = (await store.get_path(session.id, result.node.id))[-1]
    assert stored.policy_versions == result.node.policy_versions


def node(kind: NodeKind, n_prompt: int, n_output: int, spans=(), parent=None) -> ResponseNode:
    session_id = new_session_id()
    return ResponseNode(
        id=new_response_id(session_id),
        parent_id=parent,
        kind=kind,
        api="chat",
        messages=[],
        n_input_messages=0,
        prompt_ids=np.arange(n_prompt, dtype=np.int32),
        output_ids=np.arange(n_output, dtype=np.int32),
        output_logprobs=np.zeros(n_output, dtype=np.float32),
        policy_versions=tuple(spans),
    )


def test_a_trajectorys_versions_are_its_nodes_spans_at_their_place_in_the_tokens():
    path = [
        node(NodeKind.GENERATED, 5, 4, [PolicySpan(1, 0, 4)]),
        node(NodeKind.INJECTED, 3, 0),
        node(NodeKind.GENERATED, 2, 6, [PolicySpan(1, 0, 2), PolicySpan(2, 2, 6)]),  # a turn continued after a resume
        node(NodeKind.GENERATED, 2, 3, [PolicySpan(2, 0, 3)]),
    ]
    trajectory = assemble("sess_x", path)
    assert trajectory.policy_versions == [
        PolicySpan(1, 5, 9),
        PolicySpan(1, 14, 16),  # bridge tokens between: not merged with the first turn's span
        PolicySpan(2, 16, 20),
        PolicySpan(2, 22, 25),
    ]
    weights = trajectory.total_loss_weight
    for span in trajectory.policy_versions:  # exactly the generated tokens, no prompt or injected ones
        assert weights[span.start : span.end].all()
    assert sum(span.end - span.start for span in trajectory.policy_versions) == int(weights.sum())
    assert trajectory.to_json()["policy_versions"][0] == {"version": 1, "start": 5, "end": 9}
