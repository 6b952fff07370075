"""The fleet over real fake engines: probes and states, the breaker, versions, routing, membership."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
from structlog.testing import capture_logs

from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.health import EngineState
from rollout_proxy.engines.sampling import sample
from rollout_proxy.engines.vllm_http import EngineRejected, EngineUnreachable, VLLMEngine
from rollout_proxy.errors import EngineTimeout, EngineUnavailable, NotFound
from tests.conftest import free_port
from tests.fakes import FakeFleet, fake_fleet

PARAMS = SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=0)
PROMPT = np.asarray([1, 2, 3], dtype=np.int32)
FAST = FleetSettings(probe_interval=0.05, backoff_max=0.2, health_timeout=0.5)


def client(url: str) -> VLLMEngine:
    return VLLMEngine(url, bound_completions=False)


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (the fleet's prober changes states in the background)
            await asyncio.sleep(0.01)


@pytest.fixture
async def fakes(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 3) as fleet:
        yield fleet


async def started(urls: list[str], settings: FleetSettings = FAST) -> Fleet:
    fleet = Fleet([client(url) for url in urls], settings, connect=client)
    await fleet.start()
    return fleet


def states(fleet: Fleet) -> list[str]:
    return [entry["state"] for entry in fleet.view()["engines"]]  # type: ignore[index]


# -- probes, states and versions ---------------------------------------------------------------------


async def test_engines_that_answer_are_healthy_and_one_that_does_not_is_unhealthy(fakes: FakeFleet):
    fleet = await started([*fakes.urls, f"http://127.0.0.1:{free_port()}"])
    try:
        assert states(fleet) == ["healthy", "healthy", "healthy", "unhealthy"]
        view = fleet.view()
        assert view["policy_version"] == 0 and view["paused"] is False
        dead = view["engines"][3]  # type: ignore[index]
        assert "unreachable" in dead["last_error"] and dead["policy_version"] is None
        assert fleet.ready()
    finally:
        await fleet.close()


async def test_the_fleets_version_is_the_highest_integer_the_engines_report(fakes: FakeFleet):
    fakes.engines[0].weight_version = "7"
    fakes.engines[1].weight_version = "default"
    fakes.engines[2].weight_version = "5"
    fleet = await started(fakes.urls, FleetSettings(policy_version=3))
    try:
        assert fleet.version == 7
        entries = fleet.view()["engines"]
        assert [(e["state"], e["policy_version"]) for e in entries] == [  # type: ignore[union-attr]
            ("healthy", 7),
            ("stale", 3),  # "default" is --policy-version
            ("stale", 5),
        ]
        assert "version 3, the fleet's are 7" in entries[1]["last_error"]  # type: ignore[index]
    finally:
        await fleet.close()


async def test_default_weights_are_the_policy_version_setting(fakes: FakeFleet):
    fleet = await started(fakes.urls, FleetSettings(policy_version=4))
    try:
        assert fleet.version == 4 and states(fleet) == ["healthy"] * 3
    finally:
        await fleet.close()


async def test_a_version_that_is_not_an_integer_makes_that_engine_stale_and_says_why(fakes: FakeFleet):
    fakes.engines[1].weight_version = "step-12"
    fleet = await started(fakes.urls)
    try:
        assert fleet.version == 0 and states(fleet) == ["healthy", "stale", "healthy"]
        assert "'step-12', which is not an integer" in fleet.view()["engines"][1]["last_error"]  # type: ignore[index]
    finally:
        await fleet.close()


async def test_an_engine_without_dev_mode_serves_at_the_fleets_version(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 1, dev_mode=False) as fakes:
        fleet = await started(fakes.urls, FleetSettings(policy_version=2))
        try:
            assert states(fleet) == ["healthy"] and fleet.view()["engines"][0]["policy_version"] == 2  # type: ignore[index]
        finally:
            await fleet.close()


async def test_a_killed_engine_goes_unhealthy_and_comes_back_healthy_when_it_returns(fakes: FakeFleet):
    fleet = await started(fakes.urls)
    try:
        await fakes.kill(0)
        await until(lambda: states(fleet)[0] == "unhealthy")
        await fakes.restart(0)  # weights "default": the fleet's version (0), so healthy again
        await until(lambda: states(fleet)[0] == "healthy")
    finally:
        await fleet.close()


async def test_a_restarted_engine_is_stale_until_its_version_is_set(fakes: FakeFleet):
    for engine in fakes.engines:
        engine.weight_version = "3"
    fleet = await started(fakes.urls)
    try:
        assert fleet.version == 3
        await fakes.kill(0)
        await until(lambda: states(fleet)[0] == "unhealthy")
        await fakes.restart(0)  # back with "default" weights (version 0)
        await until(lambda: states(fleet)[0] == "stale")
        for _ in range(20):  # it stays out: no turn goes there
            assert (await sample(fleet, fleet.engines[0], PROMPT, PARAMS)).engine.url != fakes.urls[0]
        assert fakes.engines[0].completions == []
        entry = await fleet.admit(fakes.urls[0], policy_version=3)  # the operator loaded version 3
        assert entry["state"] == "healthy" and entry["policy_version"] == 3
        assert fakes.engines[0].weight_version == "3"  # told to the engine too
        assert (await sample(fleet, fleet.engines[0], PROMPT, PARAMS)).engine.url == fakes.urls[0]
    finally:
        await fleet.close()


async def test_a_stale_engine_that_reports_the_fleets_version_is_healthy_again(fakes: FakeFleet):
    fakes.engines[0].weight_version = fakes.engines[1].weight_version = "2"
    fakes.engines[2].weight_version = "1"
    fleet = await started(fakes.urls)
    try:
        assert states(fleet)[2] == "stale"
        fakes.engines[2].weight_version = "2"  # the trainer updated it directly on the engine
        await until(lambda: states(fleet)[2] == "healthy")
    finally:
        await fleet.close()


async def test_a_busy_engine_whose_probe_is_slow_stays_in_while_its_calls_succeed(fakes: FakeFleet):
    fleet = await started(fakes.urls[:1], FleetSettings(probe_interval=0.05, health_timeout=0.05, failure_threshold=2))
    try:
        member = fleet.members[fakes.urls[0]]
        fleet.report_success(member.client)
        for _ in range(5):
            fleet._judge(member, TimeoutError())
        assert member.state is EngineState.HEALTHY
        member.heard_at = -float("inf")  # nothing came from it lately: the probes are believed
        fleet._judge(member, TimeoutError())
        fleet._judge(member, TimeoutError())
        assert member.state is EngineState.UNHEALTHY
    finally:
        await fleet.close()


async def test_an_engine_silent_for_the_hang_timeout_is_out_at_its_first_timed_out_probe(fakes: FakeFleet):
    """However high the failure threshold, once nothing came for ``hang_timeout`` a timed-out probe takes it
    out, and every call waiting on it is woken (it fails over); a 5xx probe still needs the threshold."""
    settings = FleetSettings(probe_interval=60.0, health_timeout=0.05, failure_threshold=10, hang_timeout=0.2)
    fleet = await started(fakes.urls[:2], settings)
    try:
        hung, erring = fleet.members[fakes.urls[0]], fleet.members[fakes.urls[1]]
        waiting = hung.down
        fleet._judge(hung, TimeoutError())  # just probed: heard lately
        assert hung.state is EngineState.HEALTHY
        await asyncio.sleep(0.25)
        fleet._judge(hung, TimeoutError())
        assert hung.state is EngineState.UNHEALTHY and "hung" in (hung.last_error or "") and waiting.is_set()
        await asyncio.sleep(0.25)
        fleet._judge(erring, EngineRejected("500", engine_status=500))
        assert erring.state is EngineState.HEALTHY  # 1 of 10: answering with errors is not hanging
    finally:
        await fleet.close()


async def test_a_busy_engine_streaming_tokens_is_not_hung_while_its_probes_time_out(fakes: FakeFleet):
    settings = FleetSettings(probe_interval=0.05, health_timeout=0.05, hang_timeout=0.3, call_timeout=30.0)
    fleet = await started(fakes.urls[:1], settings)
    fake = fakes.engines[0]
    try:
        fake.delay = 1.5  # ~0.1 s a token: longer than the hang timeout in all, never silent that long
        fake.queue(" ".join(["word"] * 14))
        fleet.members[fakes.urls[0]].client.returns_routing = False  # streamed

        class Sink:
            pieces = 0

            async def begin(self, prompt_ids: np.ndarray) -> None:
                pass

            async def piece(self, piece) -> None:
                Sink.pieces += 1
                if Sink.pieces == 1:
                    fake.set_fault("hang_all")  # its API server starves from now on: no probe is answered

        params = SamplingParams(max_tokens=32, temperature=1.0, top_p=1.0, top_k=0)
        result = await sample(fleet, fleet.engines[0], PROMPT, params, sink=Sink())
        assert result.completion.finish_reason == "stop" and Sink.pieces > 10
        assert fleet.members[fakes.urls[0]].state is EngineState.HEALTHY
    finally:
        fake.set_fault(None)
        await fleet.close()


async def test_a_hung_engines_tokenize_gives_up_after_the_hang_timeout(fakes: FakeFleet):
    engine = VLLMEngine(fakes.urls[0], hang_timeout=0.3)
    try:
        await engine.info()
        fakes.engines[0].set_fault("hang_all")
        with pytest.raises(EngineTimeout):
            await engine.tokenize_text("hello")
    finally:
        fakes.engines[0].set_fault(None)
        await engine.close()


# -- calls and the breaker ----------------------------------------------------------------------------


async def test_one_refused_call_takes_an_engine_out_a_5xx_needs_the_threshold(fakes: FakeFleet):
    fleet = await started(fakes.urls, FleetSettings(probe_interval=60.0, failure_threshold=3))
    try:
        first, second, _ = fleet.members.values()
        fleet.report_failure(first.client, EngineUnavailable("the engine answered 503"))
        assert first.state is EngineState.HEALTHY  # 1 of 3
        fleet.report_failure(first.client, EngineRejected("500", engine_status=500))
        fleet.report_failure(first.client, EngineRejected("400", engine_status=400))  # the request's fault: not counted
        assert first.state is EngineState.HEALTHY
        fleet.report_failure(first.client, EngineRejected("502", engine_status=502))
        assert first.state is EngineState.UNHEALTHY and "502" in (first.last_error or "")
        fleet.report_failure(second.client, EngineUnreachable("refused"))
        assert second.state is EngineState.UNHEALTHY
    finally:
        await fleet.close()


# -- routing --------------------------------------------------------------------------------------------


async def test_new_sessions_go_to_the_least_loaded_healthy_engine_never_to_a_dead_idle_one(fakes: FakeFleet):
    fleet = await started(fakes.urls, FleetSettings(probe_interval=60.0))
    try:
        first, second, third = fleet.members.values()
        fleet.mark_down(third, "refused")  # dead, so nothing in flight: it must still get nothing
        async with first.occupied(), first.occupied(), second.occupied():
            assert fleet.pick() is second.client
        picks = {fleet.pick() for _ in range(10)}
        assert picks == {first.client, second.client}  # equal load: taken in turn
    finally:
        await fleet.close()


async def test_a_session_stays_on_its_engine_while_it_is_healthy_then_moves(fakes: FakeFleet):
    fleet = await started(fakes.urls, FleetSettings(probe_interval=60.0))
    try:
        first, second, _ = fleet.members.values()
        async with first.occupied(), first.occupied(), first.occupied():
            assert fleet.route(first.url) is first.client  # busier, still sticky
        fleet.mark_down(first, "refused")
        moved = fleet.route(first.url)
        assert moved is not first.client
        assert fleet.route("http://gone.example:1") in (second.client, fleet.members[fakes.urls[2]].client)
    finally:
        await fleet.close()


async def test_calls_in_flight_are_bounded_per_engine(fakes: FakeFleet):
    for fake in fakes.engines:
        fake.delay = 0.2
    fleet = await started(fakes.urls[:2], FleetSettings(probe_interval=60.0, max_inflight=2))
    try:
        first, second = fleet.engines
        await asyncio.gather(*(sample(fleet, engine, PROMPT, PARAMS) for engine in (first, second) * 4))
        for fake in fakes.engines[:2]:
            assert len(fake.completions) == 4
            assert fake.max_inflight == 2  # the bound (2), on each engine, not across the fleet
    finally:
        await fleet.close()


# -- membership -------------------------------------------------------------------------------------


async def test_an_engine_added_by_url_is_probed_before_the_answer(fakes: FakeFleet):
    fleet = await started(fakes.urls[:1])
    try:
        entry = await fleet.admit(fakes.urls[1])
        assert entry == {
            "url": fakes.urls[1],
            "state": "healthy",
            "policy_version": 0,
            "in_flight": 0,
            "last_error": None,
        }
        assert (await fleet.admit(fakes.urls[1] + "/"))["state"] == "healthy"  # the same engine, not a second
        assert len(fleet.members) == 2
    finally:
        await fleet.close()


async def test_removing_an_engine_drains_it(fakes: FakeFleet):
    fakes.engines[0].delay = 0.5
    fleet = await started(fakes.urls[:2], FleetSettings(probe_interval=60.0))
    try:
        first = fleet.engines[0]
        running = asyncio.create_task(sample(fleet, first, PROMPT, PARAMS))
        await until(lambda: fakes.engines[0].inflight == 1)
        entry = await fleet.remove(fakes.urls[0])
        assert entry["state"] == "draining" and entry["in_flight"] == 1
        assert (await sample(fleet, first, PROMPT, PARAMS)).engine.url == fakes.urls[1]  # no new turn there
        finished = await running
        assert finished.engine is first and finished.completion.finish_reason != "abort"  # in flight: finished
        await until(lambda: fakes.urls[0] not in fleet.members)
        assert (await fleet.remove(fakes.urls[1]))["state"] == "removed"  # idle: gone at once
        with pytest.raises(NotFound):
            await fleet.remove(fakes.urls[1])
    finally:
        await fleet.close()


async def test_close_closes_only_the_clients_the_fleet_owns(fakes: FakeFleet):
    lent = [client(url) for url in fakes.urls[:2]]
    fleet = Fleet(lent, FAST, connect=client, owned=False)
    await fleet.start()
    await fleet.admit(fakes.urls[2])
    for engine in fleet.engines:
        await engine.info()
    sessions = {engine.url: engine._session for engine in fleet.engines}  # type: ignore[attr-defined]
    await fleet.close()
    assert sessions[fakes.urls[2]].closed
    assert not sessions[fakes.urls[0]].closed and not sessions[fakes.urls[1]].closed
    for engine in lent:
        await engine.close()


# -- the wire under the fleet --------------------------------------------------------------------------


async def test_a_vllm_without_dev_mode_serves_no_versions_said_once_not_at_every_probe(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 1, dev_mode=False) as fakes:
        with capture_logs() as logs:
            fleet = await started(fakes.urls, FleetSettings(policy_version=5, probe_interval=0.01))
            try:
                member = fleet.members[fakes.urls[0]]
                for _ in range(5):
                    await fleet.probe(member)
                assert member.state is EngineState.HEALTHY and member.version == 5
            finally:
                await fleet.close()
    events = [entry["event"] for entry in logs]
    assert events.count("engine_serves_no_versions") == 1
    assert "engine_call_failed" not in events  # a 404 from /weight_info is an answer, not a failure


async def test_a_call_on_a_kept_alive_connection_the_engine_closed_is_sent_again_not_counted(fakes: FakeFleet):
    fake = fakes.engines[0]
    fleet = await started(fakes.urls[:1], FleetSettings(probe_interval=60.0, failure_threshold=1))
    try:
        await sample(fleet, fleet.engines[0], PROMPT, PARAMS)  # a connection now sits idle in the pool
        fake.set_fault("drop_reused")  # every reused connection is closed unanswered
        for _ in range(4):
            done = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
            assert done.attempts == 1 and done.completion.finish_reason in ("stop", "length")
        assert fake.dropped >= 4 and len(fake.completions) == 5
        member = fleet.members[fakes.urls[0]]
        assert member.state is EngineState.HEALTHY and member.breaker.failures == 0
        assert fleet.metrics.counters().get("engine_call_failures_total", 0) == 0
    finally:
        await fleet.close()


async def test_a_failed_call_gives_its_slot_back(fakes: FakeFleet):
    fleet = await started(fakes.urls[:1], FleetSettings(probe_interval=60.0, max_inflight=1))
    try:
        fakes.engines[0].failures.append((400, "the request's fault"))
        with pytest.raises(EngineRejected):
            await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        member = fleet.members[fakes.urls[0]]
        assert member.in_flight == 0 and member.idle.is_set()
        async with asyncio.timeout(5):  # the only slot is free again
            assert (await sample(fleet, fleet.engines[0], PROMPT, PARAMS)).engine is member.client
    finally:
        await fleet.close()


async def test_an_engine_whose_first_probe_failed_takes_a_turn_as_soon_as_a_probe_succeeds(fakes: FakeFleet):
    fake = fakes.engines[0]
    fake.set_fault("hang_all")  # a busy host: the probe at start gets no answer in time
    fleet = await started(fakes.urls[:1], FleetSettings(probe_interval=60.0, health_timeout=0.05))
    try:
        assert states(fleet) == ["unhealthy"]
        fake.set_fault(None)
        async with asyncio.timeout(5):  # not after the prober's next round (60 s): a turn probes it now
            while True:
                try:
                    done = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
                    break
                except EngineUnavailable:  # a slow host: its probe went on after the turn's short wait
                    await asyncio.sleep(0.05)
        assert done.engine.url == fakes.urls[0] and states(fleet) == ["healthy"]
        await fakes.kill(0)
        fleet.mark_down(fleet.members[fakes.urls[0]], "refused")
        with pytest.raises(EngineUnavailable):  # dead for good: refused at once, not after a wait
            async with asyncio.timeout(5):
                await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
    finally:
        await fleet.close()
