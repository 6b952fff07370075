"""LoRA policies when an engine fails: killed or hung during a load, restarted without its adapters.

What the user gets: the publish answers (bounded) with that engine's failure in words, the policy keeps serving
on the others, and an engine that comes back (or restarted between two probes) is loaded again before it takes
the policy's calls; no call is answered by the wrong adapter or lost.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from devtools.fake_lora import adapter_key
from rollout_proxy.engines.health import EngineState
from rollout_proxy.engines.policies import BASE, ZERO_SERVED
from rollout_proxy.errors import PolicyUnavailable
from tests.engines.test_policies import make_adapters, model_sent, registry, sampled_by, turn, until


@pytest.fixture(scope="module")
def dirs(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_adapters(tokenizer_dir, tmp_path_factory.mktemp("adapters"))


async def test_an_engine_killed_during_a_load_is_drained_for_the_policy_and_loaded_when_back(tokenizer_dir, dirs):
    async with registry(tokenizer_dir, settings={"probe_interval": 0.1, "backoff_max": 0.2}) as (
        fakes,
        fleet,
        policies,
    ):
        await policies.register("pol", path=dirs["v1"])
        fakes.engines[1].load_delay = 5.0
        publishing = asyncio.ensure_future(policies.publish("pol", dirs["v2"]))
        await until(lambda: len(fakes.engines[1].adapter_calls) == 3)  # zero, v1, and v2 under way
        await fakes.kill(1)
        answer = await publishing
        assert answer["version"] == 2 and [e["ok"] for e in answer["engines"]] == [True, False]
        assert "loading failed" in answer["engines"][1]["error"]
        assert policies.unserved("pol") == {fakes.urls[1]}
        sampled = await turn(fakes, fleet, "pol", engine=1)  # served by the one that took it
        assert sampled.engine.url == fakes.urls[0] and sampled_by(sampled, adapter_key(dirs["v2"]))
        await until(lambda: fleet.members[fakes.urls[1]].state is EngineState.UNHEALTHY)
        fakes.engines[1].load_delay = 0.0
        await fakes.restart(1)  # a fresh engine: no adapters at all
        await until(lambda: policies.unserved("pol") == frozenset())
        assert set(fakes.engines[1].adapters) == {ZERO_SERVED, "pol@v2"}
        back = await turn(fakes, fleet, "pol", engine=1)
        assert back.engine.url == fakes.urls[1] and sampled_by(back, adapter_key(dirs["v2"]))
        assert fleet.metrics.value("policy_adapter_reloads_total", policy="pol") >= 1


async def test_an_engine_that_hangs_during_a_load_is_given_up_on_within_the_control_timeout(tokenizer_dir, dirs):
    async with registry(tokenizer_dir, settings={"control_timeout": 1.0}) as (fakes, fleet, policies):
        await policies.register("pol", path=dirs["v1"])
        fakes.engines[0].set_fault("hang_all")
        started = time.perf_counter()
        answer = await policies.publish("pol", dirs["v2"])
        assert time.perf_counter() - started < 4.0
        assert [e["ok"] for e in answer["engines"]] == [False, True] and "loading failed" in answer["engines"][0][
            "error"
        ]
        fakes.engines[0].set_fault(None)
        sampled = await turn(fakes, fleet, "pol", engine=0)
        assert sampled.engine.url == fakes.urls[1] and sampled_by(sampled, adapter_key(dirs["v2"]))


async def test_an_engine_restarted_between_probes_is_loaded_again_and_the_call_sent_again(tokenizer_dir, dirs):
    """Its calls get vLLM's 404 on the served name: the registry loads its adapters back; nothing reaches the client."""
    async with registry(tokenizer_dir, count=1) as (fakes, fleet, policies):
        await policies.register("pol", path=dirs["v1"])
        await fakes.kill(0)
        await fakes.restart(0)  # back before any probe noticed: the fleet still counts it healthy
        assert fakes.engines[0].adapters == {}
        sampled = await turn(fakes, fleet, "pol")
        assert model_sent(fakes, sampled) == "pol@v1" and sampled_by(sampled, adapter_key(dirs["v1"]))
        assert sampled.versions[0].version == 1 and sampled.attempts == 2
        assert set(fakes.engines[0].adapters) == {ZERO_SERVED, "pol@v1"}
        await fakes.kill(0)
        await fakes.restart(0)
        base = await turn(fakes, fleet, BASE)  # named the zero adapter, got the 404: the base by its name
        assert sampled_by(base, None) and base.completion.finish_reason == "stop"
        await until(lambda: ZERO_SERVED in fakes.engines[0].adapters)


async def test_a_policy_no_engine_serves_is_refused_with_each_engines_reason(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, fleet, policies):
        fakes.engines[1].max_lora_rank = 8
        await policies.register("big", path=dirs["r16"])  # engine 1 refuses its rank
        await fakes.kill(0)
        fleet.mark_down(fleet.members[fakes.urls[0]], "killed")
        with pytest.raises(PolicyUnavailable) as unavailable:
            await turn(fakes, fleet, "big")
        message = unavailable.value.message
        assert f"{fakes.urls[0]}: unhealthy" in message
        assert f"{fakes.urls[1]}: drained for it" in message and "max_lora_rank 8" in message
        assert unavailable.value.status == 503
        assert (await turn(fakes, fleet, BASE)).engine.url == fakes.urls[1]  # the base is served on
