"""Pause and resume over fake engines in dev mode: each mode, the versions, failures, bounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from devtools.fake_engine import fake_logprob
from rollout_proxy.engines import control
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.health import EngineState
from rollout_proxy.engines.sampling import sample
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import Conflict, FleetPaused
from rollout_proxy.records import PolicySpan
from tests.fakes import FakeFleet, fake_fleet

PROMPT = np.asarray([1, 4093, 198, 1780, 314, 260], dtype=np.int32)
REPLY = list(range(1000, 1040))  # 40 tokens: long enough to be cut (the fake ends a reply with EOS, id 2)
EOS = 2
PARAMS = SamplingParams(max_tokens=64, temperature=1.0, top_p=1.0, top_k=0)


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (fake engines and the fleet change in the background)
            await asyncio.sleep(0.005)


@pytest.fixture
async def fakes(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 2, delay=1.0) as fleet:
        yield fleet


async def started(fakes: FakeFleet, **settings) -> Fleet:
    fleet = Fleet(
        [VLLMEngine(url, bound_completions=False) for url in fakes.urls], FleetSettings(probe_interval=60.0, **settings)
    )
    await fleet.start()
    return fleet


def logprobs(tokens: list[int], start: int, version: str) -> list[float]:
    return [fake_logprob(start + i, token, version) for i, token in enumerate(tokens)]


async def test_pause_fans_out_holds_new_turns_and_resume_sets_the_version_everywhere(fakes: FakeFleet):
    fleet = await started(fakes)
    try:
        answer = await control.pause(fleet, "abort")
        assert answer["paused"] and answer["failed"] == 0
        assert [e["state"] for e in answer["engines"]] == ["paused", "paused"]
        assert all(engine.paused and engine.pauses == ["abort"] for engine in fakes.engines)
        turn = asyncio.create_task(sample(fleet, fleet.engines[0], PROMPT, PARAMS))
        await asyncio.sleep(0.2)
        assert not turn.done() and all(engine.completions == [] for engine in fakes.engines)  # held in the proxy
        assert fleet.metrics.gauge("paused_turns") == 1 and fleet.metrics.gauge("engines_paused") == 1
        answer = await control.resume(fleet, 5)
        assert answer == {
            "policy_version": 5,
            "paused": False,
            "failed": 0,
            "engines": [
                {
                    "url": url,
                    "state": "healthy",
                    "policy_version": 5,
                    "in_flight": 0,
                    "last_error": None,
                    "ok": True,
                    "error": None,
                }
                for url in fakes.urls
            ],
        }
        assert [engine.weight_version for engine in fakes.engines] == ["5", "5"] and not fakes.engines[0].paused
        result = await turn
        tokens = result.completion.output_ids.tolist()
        assert result.versions == (PolicySpan(5, 0, len(tokens)),)
        assert result.completion.output_logprobs.tolist() == pytest.approx(logprobs(tokens, len(PROMPT), "5"))
        assert fleet.metrics.gauge("policy_version") == 5 and fleet.metrics.value("pause_seconds_total") > 0
    finally:
        await fleet.close()


@pytest.mark.parametrize("policy", ["continue", "regenerate"])
async def test_a_turn_an_abort_pause_cut_is_finished_after_the_resume(fakes: FakeFleet, policy: str):
    fleet = await started(fakes, abort_policy=policy)
    fake = fakes.engines[0]
    try:
        fake.delay = 0.0
        await sample(fleet, fleet.engines[0], PROMPT, PARAMS)  # the fleet learns the engine returns no MoE routing
        fake.delay, fake.generations = 1.0, []
        fake.queue(REPLY, REPLY[5:])
        turn = asyncio.create_task(sample(fleet, fleet.engines[0], PROMPT, PARAMS))
        await until(lambda: bool(fake.generations) and len(fake.generations[0].tokens) >= 5)
        await control.pause(fleet, "abort")
        cut = fake.generations[0]
        assert cut.finish_reason == "abort" and 5 <= len(cut.tokens) < len(REPLY)
        await control.resume(fleet, 1)
        result = await turn
        tokens = result.completion.output_ids.tolist()
        n = len(cut.tokens)
        assert fleet.metrics.value("abort_resubmissions_total", policy=policy, reason="abort") == 1
        if policy == "continue":  # the cut tokens are kept (version 0), the rest is sampled after them (version 1)
            resumed = fake.generations[1]
            assert resumed.prompt == PROMPT.tolist() + cut.tokens
            assert resumed.payload["max_tokens"] == PARAMS.max_tokens - n
            assert tokens == cut.tokens + resumed.tokens
            assert result.versions == (PolicySpan(0, 0, n), PolicySpan(1, n, len(tokens)))
            expected = cut.logprobs + resumed.logprobs
        else:  # sampled again from the prompt, all of it by version 1
            again = fake.generations[1]
            assert again.prompt == PROMPT.tolist() and tokens == again.tokens
            assert result.versions == (PolicySpan(1, 0, len(tokens)),)
            expected = again.logprobs
        assert result.completion.output_logprobs.tolist() == pytest.approx(expected, abs=1e-6)
        assert result.completion.prompt_ids.tolist() == PROMPT.tolist()
    finally:
        await fleet.close()


async def test_a_keep_pause_freezes_calls_and_one_the_weights_changed_under_is_sampled_again(fakes: FakeFleet):
    fleet = await started(fakes, call_timeout=1.0)  # shorter than the pause: paused time must not count
    fake = fakes.engines[0]
    try:
        fake.delay = 0.4
        fake.queue(REPLY, REPLY[:10])
        turn = asyncio.create_task(sample(fleet, fleet.engines[0], PROMPT, PARAMS))
        await until(lambda: bool(fake.generations) and len(fake.generations[0].tokens) >= 3)
        await control.pause(fleet, "keep")
        frozen = len(fake.generations[0].tokens)
        await asyncio.sleep(2.0)  # twice the call timeout
        assert len(fake.generations[0].tokens) == frozen and not turn.done()
        await control.resume(fleet, 2)
        result = await turn
        straddled = fake.generations[0]
        assert {version for version, _, _ in straddled.versions} == {"default", "2"}  # the engine mixed them
        again = fake.generations[1]  # so the proxy sampled it again, all under version 2
        assert result.completion.output_ids.tolist() == again.tokens == [*REPLY[:10], EOS]
        assert result.versions == (PolicySpan(2, 0, 11),)
        assert fleet.metrics.value("abort_resubmissions_total", policy="regenerate", reason="weights_changed") == 1
    finally:
        await fleet.close()


async def test_a_keep_pause_resumed_at_the_same_version_loses_nothing(fakes: FakeFleet):
    fleet = await started(fakes)
    fake = fakes.engines[0]
    try:
        fake.queue(REPLY)
        turn = asyncio.create_task(sample(fleet, fleet.engines[0], PROMPT, PARAMS))
        await until(lambda: bool(fake.generations) and len(fake.generations[0].tokens) >= 3)
        await control.pause(fleet, "keep")
        await control.resume(fleet, 0)  # no new weights (a pause for something else)
        result = await turn
        assert result.completion.output_ids.tolist() == [*REPLY, EOS] and len(fake.generations) == 1
        assert result.versions == (PolicySpan(0, 0, len(REPLY) + 1),)
    finally:
        await fleet.close()


async def test_a_wait_pause_answers_once_calls_in_flight_are_done(fakes: FakeFleet):
    fleet = await started(fakes)
    fake = fakes.engines[0]
    try:
        fake.queue(REPLY)
        turn = asyncio.create_task(sample(fleet, fleet.engines[0], PROMPT, PARAMS))
        await until(lambda: bool(fake.generations) and len(fake.generations[0].tokens) >= 3)
        await control.pause(fleet, "wait")
        assert turn.done()  # finished before the pause answered, at version 0
        result = turn.result()
        assert result.completion.output_ids.tolist() == [*REPLY, EOS]
        assert result.versions == (PolicySpan(0, 0, len(REPLY) + 1),)
        await control.resume(fleet, 1)
    finally:
        await fleet.close()


async def test_an_engine_that_cannot_pause_is_named_and_taken_out_without_hanging_the_pause(fakes: FakeFleet):
    fleet = await started(fakes, control_timeout=0.3)
    try:
        fakes.engines[1].set_fault("hang_all")
        started_at = time.monotonic()
        answer = await control.pause(fleet, "keep")
        assert time.monotonic() - started_at < 30  # the control timeout (0.3 s), not the hung engine
        assert answer["failed"] == 1
        ok, failed = answer["engines"]
        assert ok["ok"] and ok["state"] == "paused"
        assert not failed["ok"] and failed["state"] == "unhealthy" and "pause (keep) failed" in failed["error"]
        fakes.engines[1].set_fault(None)
        answer = await control.resume(fleet, 3)  # only the paused engine gets the new version
        assert [e["url"] for e in answer["engines"]] == [fakes.urls[0]]
        assert fakes.engines[1].weight_version == "default"
        await fleet.probe(fleet.members[fakes.urls[1]])
        assert fleet.members[fakes.urls[1]].state is EngineState.STALE  # answers again, with old weights
    finally:
        await fleet.close()


async def test_resume_without_a_pause_is_refused_unless_it_repeats_the_version(fakes: FakeFleet):
    fleet = await started(fakes)
    try:
        assert (await control.resume(fleet, 0))["engines"] == []  # a retried resume: nothing to do
        with pytest.raises(Conflict) as raised:
            await control.resume(fleet, 1)
        assert raised.value.status == 409 and raised.value.param == "policy_version"
    finally:
        await fleet.close()


async def test_turns_beyond_the_pause_queue_are_refused(fakes: FakeFleet):
    fleet = await started(fakes, pause_queue=2, pause_wait=30.0)
    try:
        await control.pause(fleet, "abort")
        queued = [asyncio.create_task(sample(fleet, fleet.engines[0], PROMPT, PARAMS)) for _ in range(2)]
        await until(lambda: fleet.gate.waiting == 2)
        with pytest.raises(FleetPaused) as raised:
            await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert raised.value.status == 503 and raised.value.code == "engines_paused" and raised.value.retry_after
        await control.resume(fleet, 1)
        assert all(result.versions[0].version == 1 for result in await asyncio.gather(*queued))
    finally:
        await fleet.close()


async def test_a_probe_between_an_engines_new_version_and_the_resume_does_not_call_it_restarted(fakes: FakeFleet):
    """The engine takes the new version first, then the fleet resumes it: a probe in between (its periodic one, or a
    turn's) hears the new version from a paused engine. That is the resume under way, not an engine restarted
    during the pause: the engine is resumed with the others and serves (CI saw the turn queued in the pause 503)."""
    fleet = await started(fakes)
    try:
        await control.pause(fleet, "keep")
        member = fleet.members[fakes.urls[0]]
        set_version = member.client.update_weight_version

        async def set_then_probed(version: str, *, within: float) -> bool:
            done = await set_version(version, within=within)
            await fleet.probe(member)  # lands before the resume sets the member's version
            return done

        member.client.update_weight_version = set_then_probed  # type: ignore[method-assign]
        answer = await control.resume(fleet, 2)
        assert [engine["state"] for engine in answer["engines"]] == ["healthy", "healthy"] and answer["failed"] == 0
        assert member.state is EngineState.HEALTHY and member.version == 2
        result = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert result.versions[0].version == 2
    finally:
        await fleet.close()


async def test_a_probe_that_heard_the_old_version_before_the_resume_does_not_make_the_engine_stale(fakes: FakeFleet):
    """A probe reads the engine's version before the resume sets the new one, and is judged while the resume is
    under way: it heard the old version of an engine just given the new one. Judged as it was, that made the engine
    stale at the version the resume had just set (CI: the turns queued in the pause got 503, "1 stale"). The probe
    asks again instead."""
    fleet = await started(fakes)
    try:
        await control.pause(fleet, "abort")
        member = fleet.members[fakes.urls[0]]
        read_version, resume_engine = member.client.weight_version, member.client.resume
        heard, resuming = asyncio.Event(), asyncio.Event()
        reads = []

        async def read_early() -> str | None:
            version = await read_version()
            reads.append(version)
            if len(reads) == 1:  # the probe started before the new version: its answer comes in the resume
                heard.set()
                await resuming.wait()
            return version

        async def resumed_while_judged(*, within: float) -> None:
            resuming.set()
            await asyncio.sleep(0.05)  # the probe is judged now, the member paused at the new version
            await resume_engine(within=within)

        member.client.weight_version = read_early  # type: ignore[method-assign]
        member.client.resume = resumed_while_judged  # type: ignore[method-assign]
        probing = asyncio.ensure_future(fleet.probe(member))
        await heard.wait()
        answer = await control.resume(fleet, 2)
        await probing
        assert [engine["state"] for engine in answer["engines"]] == ["healthy", "healthy"], answer
        assert member.state is EngineState.HEALTHY and member.version == 2
        assert reads == ["default", "2"]  # the old version heard, then asked again
        result = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert result.versions[0].version == 2
    finally:
        await fleet.close()
