"""The fleet's pause, resume, version and engines, shared by every worker on one Redis (``engines.shared``).

Two apps on two ports sharing one Redis stand in for two ``serve --workers`` processes (each has
its own store client and fleet); the admin calls go to the first, the turns to the second.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from unittest import mock

import pytest

from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.shared import SharedState, follow, settle_time
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import StoreUnavailable
from rollout_proxy.proxy import keys
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.state.redis import RedisStore
from tests.fakes import FakeFleet, fake_fleet
from tests.harness import ProxyHarness
from tests.scenarios.test_outages import RedisServer

USER = [{"role": "user", "content": "Tell me about maples."}]
SETTINGS = {"engine_probe_interval": 0.2, "pause_wait": 60.0}


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (the fleets' background tasks change what is checked)
            await asyncio.sleep(0.01)


@pytest.fixture
async def fakes(tokenizer_dir: Path) -> AsyncIterator[FakeFleet]:
    async with fake_fleet(tokenizer_dir, 2) as fleet:
        yield fleet


async def two_workers(stack: AsyncExitStack, redis_url: str, engine_urls: list[str]) -> list[ProxyHarness]:
    harnesses = []
    for index in range(2):
        store = await RedisStore.connect(redis_url)
        if index == 0:
            await store._redis.flushdb()
        stack.push_async_callback(store.close)
        harness = ProxyHarness.running(engine_urls=engine_urls, store=store, **SETTINGS)
        harnesses.append(await stack.enter_async_context(harness))
    return harnesses


@pytest.fixture
async def workers(redis_url: str, fakes: FakeFleet) -> AsyncIterator[list[ProxyHarness]]:
    async with AsyncExitStack() as stack:
        yield await two_workers(stack, redis_url, fakes.urls)


async def engines_of(worker: ProxyHarness) -> dict:
    status, body = await worker.request("GET", "/v1/admin/engines")
    assert status == 200, body
    return body


@pytest.mark.parametrize("mode", ["abort", "keep"])
async def test_a_pause_through_one_worker_holds_the_turns_of_another_until_the_resume(
    workers: list[ProxyHarness], fakes: FakeFleet, mode: str
) -> None:
    first, second = workers
    session = await first.create_session(USER, max_new_tokens=24)
    on_second = second.client(second.url + "/v1", session.api_key)
    reply = await on_second.chat.completions.create(model="m", messages=USER)
    history = [*USER, reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]

    status, paused = await first.request("POST", "/v1/admin/pause", json={"mode": mode})
    assert status == 200 and paused["paused"] and paused["failed"] == 0, paused
    assert all(engine.paused for engine in fakes.engines)
    view = await engines_of(second)  # closed before the pause answered, not a poll later
    assert view["paused"] and {engine["state"] for engine in view["engines"]} == {"paused"}
    arrived = [len(engine.completions) for engine in fakes.engines]

    turn = asyncio.create_task(on_second.chat.completions.create(model="m", messages=history))
    fleet = second.app[keys.ENGINES]
    await until(lambda: fleet.gate.waiting == 1)
    await asyncio.sleep(4 * fleet.settings.follow_interval)
    assert not turn.done()
    assert [len(engine.completions) for engine in fakes.engines] == arrived  # nothing reached an engine

    status, resumed = await first.request("POST", "/v1/admin/resume", json={"policy_version": 7})
    assert status == 200 and not resumed["paused"] and resumed["policy_version"] == 7, resumed
    answer = await asyncio.wait_for(turn, 30)
    trajectory = await second.trajectory(answer.id)
    fakes.check_trajectory(trajectory)  # every token is what an engine sampled, at the version it reported
    assert [span["version"] for span in trajectory["policy_versions"]] == [0, 7]

    await asyncio.sleep(3 * SETTINGS["engine_probe_interval"])  # probes saw the engines report "7"
    for worker in workers:
        view = await engines_of(worker)
        assert view["policy_version"] == 7 and not view["paused"]
        assert [(e["state"], e["policy_version"]) for e in view["engines"]] == [("healthy", 7)] * 2


async def test_a_call_in_flight_on_another_worker_across_a_weight_update_is_sampled_again(
    workers: list[ProxyHarness], fakes: FakeFleet
) -> None:
    """A keep-mode pause freezes the second worker's call; after the resume to 7 the call's tokens are all 7's
    (its first tokens came from the old weights: it is regenerated, never credited to either version whole)."""
    first, second = workers
    for engine in fakes.engines:
        engine.delay = 6.0  # far longer than the pause takes to reach the engines
    session = await first.create_session(USER, max_new_tokens=40)
    on_second = second.client(second.url + "/v1", session.api_key)
    turn = asyncio.create_task(on_second.chat.completions.create(model="m", messages=USER))
    await until(lambda: any(len(g.tokens) >= 2 for e in fakes.engines for g in e.generating))
    status, _ = await first.request("POST", "/v1/admin/pause", json={"mode": "keep"})
    assert status == 200
    assert not turn.done()  # frozen on its engine
    for engine in fakes.engines:
        engine.delay = 0.0  # the call sampled again is quick
    status, _ = await first.request("POST", "/v1/admin/resume", json={"policy_version": 7})
    assert status == 200
    answer = await asyncio.wait_for(turn, 30)
    trajectory = await second.trajectory(answer.id)
    fakes.check_trajectory(trajectory)
    assert [span["version"] for span in trajectory["policy_versions"]] == [7]
    metric = second.app[keys.METRICS].value
    assert metric("abort_resubmissions_total", policy="regenerate", reason="weights_changed") == 1


async def test_engines_added_and_removed_through_one_worker_are_added_and_removed_on_the_other(
    redis_url: str, tokenizer_dir: Path
) -> None:
    async with fake_fleet(tokenizer_dir, 2) as fakes, AsyncExitStack() as stack:
        first, second = await two_workers(stack, redis_url, fakes.urls[:1])
        status, added = await first.request("POST", "/v1/admin/engines", json={"url": fakes.urls[1]})
        assert status == 200 and added["state"] == "healthy", added
        await until(lambda: fakes.urls[1] in second.app[keys.ENGINES].members)
        await until(lambda: second.app[keys.ENGINES].members[fakes.urls[1]].routable)  # probed in the background

        status, removed = await first.request("DELETE", f"/v1/admin/engines?url={fakes.urls[0]}")
        assert status == 200, removed
        await until(lambda: fakes.urls[0] not in second.app[keys.ENGINES].members)
        view = await engines_of(second)
        assert [(engine["url"], engine["state"]) for engine in view["engines"]] == [(fakes.urls[1], "healthy")]

        # a worker started now follows what was decided before it
        store = await RedisStore.connect(redis_url)
        stack.push_async_callback(store.close)
        third = await stack.enter_async_context(
            ProxyHarness.running(engine_urls=fakes.urls[:1], store=store, **SETTINGS)
        )
        await until(lambda: list(third.app[keys.ENGINES].members) == [fakes.urls[1]])


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to kill or freeze."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_a_pause_the_store_cannot_share_is_refused_and_changes_nothing(
    own_redis: RedisServer, fakes: FakeFleet, fault: str
) -> None:
    """Redis killed or hung: the pause answers 503 (bounded) before any gate closes or any engine is paused,
    and the other worker, whose reads fail meanwhile, goes on as it was."""
    async with AsyncExitStack() as stack:
        first, second = await two_workers(stack, own_redis.url, fakes.urls)
        getattr(own_redis, fault)()
        async with asyncio.timeout(30):
            status, body = await first.request("POST", "/v1/admin/pause", json={"mode": "abort"})
        assert status == 503 and body["error"]["code"] == "store_unavailable", body
        assert not first.app[keys.ENGINES].paused and not second.app[keys.ENGINES].paused
        assert not any(engine.paused for engine in fakes.engines) and not any(e.pauses for e in fakes.engines)
        await asyncio.sleep(4 * second.app[keys.ENGINES].settings.follow_interval)
        assert not second.app[keys.ENGINES].paused
        own_redis.stop()  # thawed and gone before the workers close


async def test_the_pause_waits_out_the_window_in_which_other_workers_close_their_gates(
    workers: list[ProxyHarness], fakes: FakeFleet
) -> None:
    first, _ = workers
    fleet = first.app[keys.ENGINES]
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _ = await first.request("POST", "/v1/admin/pause", json={"mode": "abort"})
    assert status == 200
    assert loop.time() - started >= settle_time(fleet)  # the promised window, waited before the engines pause
    state = await fleet.shared.get_fleet_state()
    assert SharedState.from_json(state).paused
    await first.request("POST", "/v1/admin/resume", json={"policy_version": 0})


async def test_the_store_keeps_one_fleet_state(store: object) -> None:
    assert await store.get_fleet_state() is None  # type: ignore[attr-defined]
    state = SharedState(version=3, paused=True, mode="keep", added=("http://a:1",))
    await store.put_fleet_state(state.to_json())  # type: ignore[attr-defined]
    assert SharedState.from_json(await store.get_fleet_state()) == state  # type: ignore[attr-defined]
    await store.put_fleet_state(SharedState(version=4).to_json())  # type: ignore[attr-defined]
    assert SharedState.from_json(await store.get_fleet_state()) == SharedState(version=4)  # type: ignore[attr-defined]


async def test_an_engine_at_the_version_another_worker_is_resuming_to_is_not_stale(fakes: FakeFleet) -> None:
    """Between the leader setting the engines' version and this worker reading the resume, its probes already see
    the new version: the engine stays paused here (not stale), then is healthy at the version it reported."""
    store = MemoryStore()  # shared by hand: the fleets follow any store with the method pair
    fleet = Fleet(
        [VLLMEngine(url, bound_completions=False) for url in fakes.urls],
        FleetSettings(probe_interval=60.0, follow_interval=60.0),  # no background reads: followed by hand
        shared=store,
    )
    await fleet.start()
    try:
        await store.put_fleet_state(SharedState(version=0, paused=True, mode="keep").to_json())
        await follow(fleet)
        epochs = [member.epoch for member in fleet.members.values()]
        await store.put_fleet_state(SharedState(version=0, paused=True, mode="keep", next_version=7).to_json())
        await follow(fleet)
        assert [member.epoch for member in fleet.members.values()] == [e + 1 for e in epochs]  # calls in flight
        for engine in fakes.engines:
            engine.weight_version = "7"  # the leader's update_weight_version
        for member in fleet.members.values():
            await fleet.probe(member)
        assert {member.state.value for member in fleet.members.values()} == {"paused"}
        await store.put_fleet_state(SharedState(version=7).to_json())
        await follow(fleet)
        assert not fleet.paused and fleet.version == 7
        assert [(m.state.value, m.version) for m in fleet.members.values()] == [("healthy", 7)] * 2
    finally:
        await fleet.close()


class CancelAsStoreError(MemoryStore):
    """A store whose read turns a cancel into its own error, as redis-py's timeouts can: the cancel is lost."""

    async def get_fleet_state(self):  # type: ignore[no-untyped-def]
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise StoreUnavailable("the store read was interrupted") from None


async def test_closing_a_fleet_whose_store_swallows_the_cancel_does_not_hang(fakes: FakeFleet) -> None:
    """The follower stops even when the cancel comes out of the store call as a store error."""
    store = CancelAsStoreError()
    fleet = Fleet(
        [VLLMEngine(url, bound_completions=False) for url in fakes.urls],
        FleetSettings(probe_interval=60.0, follow_interval=0.01),
        shared=store,
    )
    with mock.patch.object(CancelAsStoreError, "get_fleet_state", MemoryStore.get_fleet_state):
        await fleet.start()  # the first read at start answers
    await asyncio.sleep(0.1)  # the follower is now inside its (hanging) store read
    await asyncio.wait_for(fleet.close(), timeout=10)
    assert all(task.done() for task in fleet._tasks)
