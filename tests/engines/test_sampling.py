"""A turn's call through the fleet, against fake engines with faults: failover, bounds, salts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from devtools.fake_engine import fake_logprob
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.health import EngineState
from rollout_proxy.engines.sampling import Sampled, cache_salt, sample
from rollout_proxy.engines.vllm_http import EngineRejected, VLLMEngine
from rollout_proxy.errors import EngineTimeout
from rollout_proxy.records import PolicySpan
from tests.fakes import FakeFleet, fake_fleet

PARAMS = SamplingParams(max_tokens=32, temperature=1.0, top_p=1.0, top_k=0)
PROMPT = np.asarray([1, 4093, 198, 1780, 314, 260], dtype=np.int32)


@pytest.fixture
async def fakes(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 3) as fleet:
        yield fleet


async def started(fakes: FakeFleet, **settings) -> Fleet:
    fleet = Fleet(
        [VLLMEngine(url, bound_completions=False) for url in fakes.urls],
        FleetSettings(probe_interval=60.0, **settings),  # probes stay out of the way unless a test wants them
    )
    await fleet.start()
    return fleet


def answered_by(fakes: FakeFleet, result: Sampled) -> None:
    """The result is exactly one engine's whole completion of the prompt: its tokens and logprobs."""
    matches = fakes.completed(PROMPT.tolist(), result.completion.output_ids.tolist())
    (generation,) = [generation for url, generation in matches if url == result.engine.url]
    assert result.completion.output_logprobs.tolist() == pytest.approx(generation.logprobs, abs=1e-6)
    assert result.versions == (PolicySpan(0, 0, len(generation.tokens)),)


@pytest.mark.parametrize("fault", ["refuse", "reset", "error"])
async def test_a_failed_call_is_sent_to_another_engine_and_nothing_of_it_is_kept(fakes: FakeFleet, fault: str):
    fleet = await started(fakes)
    try:
        first = fleet.engines[0]
        if fault == "refuse":
            await fakes.kill(0)
        else:
            fakes.engines[0].set_fault(fault)
        result = await sample(fleet, first, PROMPT, PARAMS)
        assert result.engine is not first and result.attempts == 2
        answered_by(fakes, result)
        assert fleet.metrics.value("engine_retries_total") == 1
        if fault == "reset":  # the engine generated, the proxy got half an answer: none of it is used
            assert fakes.engines[0].generations and fakes.engines[0].generations[0].tokens
        expected = EngineState.HEALTHY if fault == "error" else EngineState.UNHEALTHY  # one 5xx is not 3
        assert fleet.members[fakes.urls[0]].state is expected
    finally:
        await fleet.close()


async def test_a_hung_call_fails_over_after_the_call_timeout(fakes: FakeFleet):
    fleet = await started(fakes, call_timeout=0.4)
    try:
        fakes.engines[0].set_fault("hang")
        started_at = time.monotonic()
        result = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert time.monotonic() - started_at >= 0.4  # it waited the call timeout out (timers never fire early)
        assert result.engine.url != fakes.urls[0]
        assert fakes.engines[0].completions and fakes.engines[0].generations == []  # the hung call, given up
        answered_by(fakes, result)
    finally:
        await fleet.close()


async def test_a_call_on_an_engine_the_probes_find_dead_fails_over_before_its_timeout(fakes: FakeFleet):
    fleet = Fleet(
        [VLLMEngine(url, bound_completions=False) for url in fakes.urls],
        FleetSettings(probe_interval=0.05, health_timeout=0.1, failure_threshold=2, call_timeout=60.0),
    )
    await fleet.start()
    try:
        fakes.engines[0].set_fault("hang_all")  # stopped: not even /health answers
        started_at = time.monotonic()
        result = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert time.monotonic() - started_at < 10.0  # the probes, not the 60 s call timeout
        assert result.engine.url != fakes.urls[0]
        assert fleet.members[fakes.urls[0]].state is EngineState.UNHEALTHY
    finally:
        await fleet.close()


async def test_retries_are_bounded_and_the_last_failure_is_the_answer(fakes: FakeFleet):
    fleet = await started(fakes, retries=1)
    try:
        for engine in fakes.engines:
            engine.set_fault("error")
        with pytest.raises(EngineRejected) as raised:
            await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert raised.value.status == 502 and "injected fault" in raised.value.message
        assert sum(len(engine.completions) for engine in fakes.engines) == 2  # the call and one retry
    finally:
        await fleet.close()


async def test_the_turn_deadline_bounds_every_try_together(fakes: FakeFleet):
    fleet = await started(fakes, call_timeout=0.3, turn_deadline=0.5, retries=5)
    try:
        for engine in fakes.engines:
            engine.set_fault("hang")
        started_at = time.monotonic()
        with pytest.raises(EngineTimeout) as raised:
            await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert time.monotonic() - started_at >= 0.5
        # the deadline, not the 5 retries, ended it: 0.3 s calls fit twice in 0.5 s, never six times
        assert sum(len(engine.completions) for engine in fakes.engines) == 2
        assert raised.value.status == 504 and raised.value.retry_after
    finally:
        await fleet.close()


async def test_a_request_the_engine_refuses_is_not_retried_elsewhere(fakes: FakeFleet):
    fleet = await started(fakes)
    try:
        fakes.engines[0].failures.append((400, "max_tokens is too large"))
        with pytest.raises(EngineRejected) as raised:
            await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert raised.value.engine_status == 400
        assert [len(engine.completions) for engine in fakes.engines] == [1, 0, 0]
        assert fleet.members[fakes.urls[0]].state is EngineState.HEALTHY
    finally:
        await fleet.close()


async def test_a_slow_engine_is_waited_for_not_failed_over(fakes: FakeFleet):
    fleet = await started(fakes, call_timeout=30.0)
    try:
        fakes.engines[0].set_fault("slow")
        fakes.engines[0].slow_delay = 0.02
        result = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert result.engine.url == fakes.urls[0] and result.attempts == 1
        answered_by(fakes, result)
    finally:
        await fleet.close()


async def test_every_call_carries_its_versions_cache_salt_and_logprobs_follow_the_weights(fakes: FakeFleet):
    for engine in fakes.engines:
        engine.weight_version = "9"
    fleet = await started(fakes)
    try:
        result = await sample(fleet, fleet.engines[0], PROMPT, PARAMS)
        assert fakes.engines[0].completions[-1]["cache_salt"] == cache_salt(9) == "rollout-proxy-policy-v9"
        expected = [fake_logprob(len(PROMPT) + i, t, "9") for i, t in enumerate(result.completion.output_ids.tolist())]
        assert result.completion.output_logprobs.tolist() == pytest.approx(expected, abs=1e-6)
        assert result.versions == (PolicySpan(9, 0, len(result.completion.output_ids)),)
    finally:
        await fleet.close()
