"""One turn service for the three APIs (``core.turn_service``): a chat, a Responses and a Messages request
go through the same driver, and differ only where their placement says; a streamed turn records what a
whole one does, a count is the prompt of the turn that follows, appended messages make a weight-0 node."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_proxy.core.chat import ChatPlacement
from rollout_proxy.core.messages import MessagesPlacement
from rollout_proxy.core.responses import ResponsesPlacement
from rollout_proxy.core.streaming import TurnDone
from rollout_proxy.core.turn_service import Ask, TurnService
from rollout_proxy.errors import InvalidRequest
from rollout_proxy.records import NodeKind
from rollout_proxy.state.store import ReadAhead, SessionLease
from tests.core.builders import session_record

QUESTION = {"role": "user", "content": "What is 2+2?"}
PLACEMENTS: dict[str, Any] = {
    "chat": ChatPlacement(),
    "responses": ResponsesPlacement(store=False),
    "messages": MessagesPlacement(),
}


async def lease(turns) -> SessionLease:
    session = session_record(engine=turns.engine.url, now=turns.clock.now)
    await turns.store.create_session(session)
    leased = await turns.store.lease_session(session.id, ReadAhead())
    assert leased is not None
    return leased


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_the_three_apis_take_the_same_turn_through_one_driver(turns):
    service = TurnService(tree=turns.tree, turns=turns.runner)
    results = {}
    for api, placing in PLACEMENTS.items():
        turns.fake.queue("Four.")
        results[api] = await service.complete(await lease(turns), Ask([QUESTION]), placing)
    nodes = {api: result.node for api, result in results.items()}
    assert {api: node.api for api, node in nodes.items()} == {api: api for api in PLACEMENTS}
    assert len({tuple(result.prompt_ids.tolist()) for result in results.values()}) == 1  # one prompt
    assert all(node.messages == [QUESTION, {"role": "assistant", "content": "Four."}] for node in nodes.values())
    # what only the Responses placement records of its request
    assert nodes["responses"].meta == {"previous_response_id": None, "instructions": None, "store": False}
    assert nodes["chat"].meta == nodes["messages"].meta == {}


@pytest.mark.parametrize("template_name", ["qwen3_style"])
@pytest.mark.parametrize("api", list(PLACEMENTS))
async def test_a_streamed_turn_records_what_a_whole_one_does(turns, api):
    service = TurnService(tree=turns.tree, turns=turns.runner)
    turns.fake.queue("Four.", "Four.")
    whole = await service.complete(await lease(turns), Ask([QUESTION], meta={"k": 1}), PLACEMENTS[api])
    stream = await service.stream(await lease(turns), Ask([QUESTION], meta={"k": 1}), PLACEMENTS[api])
    events = [event async for event in stream]
    assert isinstance(events[-1], TurnDone)
    streamed = events[-1].result.node
    for field in ("api", "messages", "prompt_ids", "output_ids", "output_logprobs", "finish_reason", "meta"):
        assert str(getattr(streamed, field)) == str(getattr(whole.node, field)), field


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_a_count_is_the_prompt_of_the_turn_that_follows_and_stores_nothing(turns):
    service = TurnService(tree=turns.tree, turns=turns.runner)
    leased = await lease(turns)
    count = await service.count_tokens(leased, Ask([QUESTION]), MessagesPlacement())
    assert await turns.store.get_nodes(leased.session.id) == []
    result = await service.complete(leased, Ask([QUESTION]), MessagesPlacement())
    assert count == len(result.prompt_ids)


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_appended_messages_are_a_weight_zero_node_made_once(turns):
    service = TurnService(tree=turns.tree, turns=turns.runner)
    leased = await lease(turns)
    injected = ResponsesPlacement(api="injected")
    told = [QUESTION, {"role": "assistant", "content": "Four, as you know."}]
    node = await service.append(leased, Ask(told), injected)
    assert node.kind is NodeKind.INJECTED and node.api == "injected" and node.messages == told
    assert (await service.append(leased, Ask(told), injected)).id == node.id  # already in the tree
    with pytest.raises(InvalidRequest, match="must not be empty"):
        await service.append(leased, Ask([]), injected)
