"""SessionService over each store: create, the open-session check, and finishing exactly once."""

from __future__ import annotations

import asyncio

import pytest

from rollout_proxy.core.rendering import Renderers, RenderingConfig
from rollout_proxy.core.sessions import SessionService
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.health import EngineState
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import Conflict, InvalidRequest, NotFound, SessionNotFound
from rollout_proxy.ids import new_response_id, new_session_id
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import GenerationConfig, SessionStatus
from tests.core.builders import put_node

SAMPLE = [{"role": "user", "content": "What is 2+2?"}]
ANSWER = {"role": "assistant", "content": "4."}
TTL = 120.0


@pytest.fixture
async def fleet():
    # the service only pins an engine's URL: the engines are taken as probed healthy (nothing answers there)
    engines = Fleet([VLLMEngine("http://127.0.0.1:1/a"), VLLMEngine("http://127.0.0.1:1/b")])
    for member in engines.members.values():
        member.state, member.version = EngineState.HEALTHY, 0
    yield engines
    await engines.close()


@pytest.fixture
def service(store, fleet) -> SessionService:
    return SessionService(
        store=store, engines=fleet, ttl=TTL, renderers=Renderers(RenderingConfig(), metrics=Metrics())
    )


async def create(service: SessionService, *, n_sample: int | None = None):
    return await service.create(
        messages=list(SAMPLE),
        tools=None,
        extra={"answer": 4},
        generation=GenerationConfig(max_new_tokens=16),
        context={"step": 3},
        n_sample=n_sample,
    )


async def answer(store, session_id: str) -> str:
    path = await put_node(store, session_id, [], [*SAMPLE, ANSWER])
    return path[-1].id


async def finish(service: SessionService, session_id: str, *, status: str = "success", responses=None, extra=None):
    return await service.finish(
        session_id, status=status, error=None, extra=extra or {}, responses=responses, config=None
    )


async def test_create_stores_an_open_session_pinned_to_the_least_loaded_engine(service, fleet):
    busy, idle = fleet.members.values()
    async with busy.occupied():
        session = await create(service)
    assert session.engine == idle.url
    assert session.status is SessionStatus.OPEN and session.result is None
    assert session.expires_at - session.created_at == pytest.approx(TTL)
    assert (await service.get(session.id)).to_dict() == session.to_dict()
    assert (await service.get_open(session.id)).id == session.id


async def test_a_new_session_never_goes_to_an_engine_that_is_down_however_idle(service, fleet):
    """The measured bug: "least loaded" chose a dead engine, which had nothing in flight."""
    dead, alive = fleet.members.values()
    fleet.mark_down(dead, "refused")
    async with alive.occupied(), alive.occupied():
        sessions = [await create(service) for _ in range(4)]
    assert {session.engine for session in sessions} == {alive.url}


async def test_with_no_engine_serving_a_session_is_made_without_one(service, fleet):
    for member in fleet.members.values():
        fleet.mark_down(member, "refused")
    session = await create(service)
    assert session.engine is None and (await service.get(session.id)).engine is None


async def test_an_unknown_session_is_not_found(service):
    with pytest.raises(SessionNotFound) as raised:
        await service.get(new_session_id())
    assert raised.value.param == "session_id"
    with pytest.raises(SessionNotFound):
        await finish(service, new_session_id())


async def test_a_single_rollout_that_names_nothing_emits_its_latest_response(service, store):
    session = await create(service)
    response_id = await answer(store, session.id)
    finished, trajectories = await finish(service, session.id)
    assert [t.response_id for t in trajectories] == [response_id]
    assert trajectories[0].messages == [*SAMPLE, ANSWER]
    assert finished.status is SessionStatus.FINISHED
    assert finished.result["responses"] == [{"id": response_id, "extra": None}]
    assert (await service.get(session.id)).result == finished.result


async def test_a_rollout_without_responses_emits_nothing(service, store):
    empty = await create(service)
    assert (await finish(service, empty.id))[1] == []
    failed = await create(service)
    await answer(store, failed.id)
    finished, trajectories = await finish(service, failed.id, status="failure")
    assert trajectories == [] and finished.result["status"] == "failure"


async def test_each_response_extra_is_merged_over_the_rollout_extra(service, store):
    session = await create(service)
    first, second = await answer(store, session.id), await answer(store, session.id)
    responses = [{"id": second, "extra": {"score": 1}}, {"id": first, "extra": None}]
    _, trajectories = await finish(service, session.id, responses=responses, extra={"score": 0, "tag": "x"})
    assert [t.response_id for t in trajectories] == [second, first]
    assert [t.extra for t in trajectories] == [{"score": 1, "tag": "x"}, {"score": 0, "tag": "x"}]
    assert (await service.trajectory(second)).extra == {"score": 1, "tag": "x"}


async def assert_nothing_recorded(service, session_id: str) -> None:
    session = await service.get(session_id)
    assert session.status is SessionStatus.OPEN and session.result is None


async def test_response_ids_must_belong_to_the_session(service, store):
    session, other = await create(service), await create(service)
    mine, theirs = await answer(store, session.id), await answer(store, other.id)
    for bad in (theirs, new_response_id(session.id), "not-a-response-id"):
        with pytest.raises(InvalidRequest) as raised:
            await finish(service, session.id, responses=[{"id": mine}, {"id": bad}])
        assert raised.value.param == "responses[1].id"
        await assert_nothing_recorded(service, session.id)
    with pytest.raises(InvalidRequest) as raised:
        await finish(service, session.id, responses=[{"id": mine}, {"id": mine}])
    assert raised.value.param == "responses"
    await assert_nothing_recorded(service, session.id)
    # the failed checks left the session finishable
    _, trajectories = await finish(service, session.id, responses=[{"id": mine}])
    assert [t.response_id for t in trajectories] == [mine]


async def test_a_group_that_succeeds_names_exactly_n_sample(service, store):
    session = await create(service, n_sample=2)
    ids = [await answer(store, session.id) for _ in range(3)]
    for named in ([], ids[:1], ids):
        with pytest.raises(InvalidRequest) as raised:
            await finish(service, session.id, responses=[{"id": i} for i in named])
        assert raised.value.param == "responses"
        await assert_nothing_recorded(service, session.id)
    with pytest.raises(InvalidRequest):  # a group never falls back to its latest response
        await finish(service, session.id)
    _, trajectories = await finish(service, session.id, responses=[{"id": i} for i in ids[1:]])
    assert [t.response_id for t in trajectories] == ids[1:]


async def test_a_failed_group_may_name_fewer(service, store):
    session = await create(service, n_sample=4)
    response_id = await answer(store, session.id)
    _, trajectories = await finish(service, session.id, status="failure", responses=[{"id": response_id}])
    assert [t.response_id for t in trajectories] == [response_id]


async def test_a_session_finishes_once(service, store):
    session = await create(service)
    await answer(store, session.id)
    await finish(service, session.id)
    with pytest.raises(Conflict):
        await finish(service, session.id)
    with pytest.raises(Conflict):
        await service.get_open(session.id)
    assert (await service.get(session.id)).status is SessionStatus.FINISHED


async def test_concurrent_finishes_record_one_result(service, store):
    session = await create(service)
    await answer(store, session.id)
    outcomes = await asyncio.gather(
        *(finish(service, session.id, extra={"n": n}) for n in range(6)), return_exceptions=True
    )
    winners = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(outcome, Conflict) for outcome in outcomes if isinstance(outcome, BaseException))
    assert (await service.get(session.id)).result == winners[0][0].result


async def test_trajectories_are_found_only_in_their_session(service, store):
    session, other = await create(service), await create(service)
    response_id = await answer(store, session.id)
    assert (await service.trajectory(response_id, session_id=session.id)).response_id == response_id
    with pytest.raises(NotFound):
        await service.trajectory(response_id, session_id=other.id)
    with pytest.raises(NotFound):
        await service.trajectory(new_response_id(session.id))
    assert (await service.latest_trajectory(session.id)).response_id == response_id
    with pytest.raises(NotFound):
        await service.latest_trajectory(other.id)


def trained_nodes(trajectory, path) -> list[str]:
    """The nodes of ``path`` whose output tokens the trajectory trains (all of them: weight 1, else none: 0)."""
    weights, logprobs, position, trained = trajectory.total_loss_weight, trajectory.total_token_logprobs, 0, []
    for node in path:
        position += len(node.prompt_ids)
        span = slice(position, position + len(node.output_ids))
        assert set(weights[span].tolist()) in ({1.0}, {0.0}, set())
        if weights[span].all() and len(node.output_ids):
            trained.append(node.id)
            assert (logprobs[span] == node.output_logprobs).all()
        else:
            assert (logprobs[span] == 0.0).all()  # as the export weights a turn trained elsewhere
        position += len(node.output_ids)
    assert weights.sum() == sum(len(n.output_ids) for n in path if n.id in trained)
    return trained


async def test_a_finish_naming_responses_trains_each_shared_turn_once_in_the_first_named(service, store):
    """An edited turn shares the turns before it: the first named response that holds a turn trains it."""
    session = await create(service)
    first = await put_node(store, session.id, [], [*SAMPLE, ANSWER])
    main = await put_node(store, session.id, first, [{"role": "user", "content": "And 3+3?"}, ANSWER])
    edited = await put_node(store, session.id, first, [{"role": "user", "content": "And 4+4?"}, ANSWER])
    _, (a, b) = await finish(service, session.id, responses=[{"id": edited[-1].id}, {"id": main[-1].id}])
    assert trained_nodes(a, edited) == [first[0].id, edited[-1].id]
    assert trained_nodes(b, main) == [main[-1].id]  # the shared first turn: weight 0, logprob 0.0
    # named the other way round, the other one trains it
    again = await create(service)
    first = await put_node(store, again.id, [], [*SAMPLE, ANSWER])
    main = await put_node(store, again.id, first, [{"role": "user", "content": "And 3+3?"}, ANSWER])
    _, (a, b) = await finish(service, again.id, responses=[{"id": main[-1].id}, {"id": first[-1].id}])
    assert trained_nodes(a, main) == [first[0].id, main[-1].id] and trained_nodes(b, first) == []
    # a response fetched by its id is the whole path, trained: the finish's rule is the finish's
    assert trained_nodes(await service.trajectory(first[-1].id), first) == [first[0].id]


async def test_a_named_retry_is_trained_though_the_sessions_retry_policy_drops_it(service, store):
    """``retry: drop`` decides for the finish that names nothing; naming a response trains it."""
    session = await create(service)
    first = await put_node(store, session.id, [], [*SAMPLE, ANSWER])
    retried = [{"role": "user", "content": "And 3+3?"}, ANSWER]
    one = await put_node(store, session.id, first, retried)
    two = await put_node(store, session.id, first, retried)
    export = await service.rollout(session.id)
    assert export.dropped_tokens == len(one[-1].output_ids)  # the export drops one of the two
    _, (a, b) = await finish(service, session.id, responses=[{"id": one[-1].id}, {"id": two[-1].id}])
    assert trained_nodes(a, one) == [first[0].id, one[-1].id] and trained_nodes(b, two) == [two[-1].id]
    assert a.rollout_counts is None and b.rollout_counts is None  # each named one is what it is


async def test_a_group_whose_samples_share_a_turn_trains_it_in_the_first_sample_that_holds_it(service, store):
    """The seed's group example: three responses, two of them continuing the first."""
    session = await create(service, n_sample=3)
    r1 = await put_node(store, session.id, [], [*SAMPLE, ANSWER])
    r2 = await put_node(store, session.id, r1, [{"role": "user", "content": "And 3+3?"}, ANSWER])
    r3 = await put_node(store, session.id, r1, [{"role": "user", "content": "And 4+4?"}, ANSWER])
    _, (a, b, c) = await finish(service, session.id, responses=[{"id": r[-1].id} for r in (r1, r2, r3)])
    assert trained_nodes(a, r1) == [r1[0].id]
    assert trained_nodes(b, r2) == [r2[-1].id] and trained_nodes(c, r3) == [r3[-1].id]


async def test_a_whole_rollout_carries_its_counts_dropped_retries_included(service, store):
    session = await create(service)
    first = await put_node(store, session.id, [], [*SAMPLE, ANSWER])
    retried = [{"role": "user", "content": "And 3+3?"}, ANSWER]
    for _ in range(2):
        await put_node(store, session.id, first, retried)
    await put_node(store, session.id, [], [{"role": "user", "content": "A subagent's task."}, ANSWER])
    export = await service.rollout(session.id)
    _, (main,) = await finish(service, session.id)
    assert main.rollout_counts == {
        "sequences": 2,  # the main one (the subagent's: the latest leaf) and the retry kept (the latest of two)
        "sampled_tokens": 12,
        "trained_tokens": 9,
        "dropped_tokens": 3,
        "dropped_sequences": 1,
    }
    assert main.rollout_counts["sampled_tokens"] == export.sampled_tokens
    assert sum(float(s.total_loss_weight.sum()) for s in [main, *main.branches]) == export.trained_tokens
    assert len(export.sequences) == 3 and [s.dropped for s in export.sequences].count(True) == 1
