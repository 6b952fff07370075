"""The policy registry over fake engines that serve LoRA adapters: publish, switch, hold, unload, drain.

Each adapter's files decide the fake's logprobs (``devtools.fake_lora.adapter_key``), so every check below says
which adapter version sampled a token, not only which name was sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.fake_engine import FakeMoE, fake_logprob
from devtools.fake_lora import adapter_key
from devtools.lora_adapter import build_adapter
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.policies import BASE, MAX_POLICIES, MOE_REFUSAL, ZERO_SERVED, Policies
from rollout_proxy.engines.sampling import Sampled, sample
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import (
    AdapterRefused,
    InvalidRequest,
    PolicyRetired,
    PolicyUnavailable,
    StoreUnavailable,
    UnknownPolicy,
)
from rollout_proxy.records import PolicySpan
from rollout_proxy.state.memory import MemoryStore
from tests.fakes import FakeFleet, fake_fleet

PROMPT = np.asarray([1, 4093, 198, 1780, 314, 260], dtype=np.int32)
REPLY = [1000, 1001, 1002, 1003, 1004, 1005]
PARAMS = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (the engines and the registry change in the background)
            await asyncio.sleep(0.005)


def make_adapters(tokenizer_dir: Path, root: Path) -> dict[str, str]:
    """Four rank-8 adapters (q and v) with different weights, and one of rank 16."""
    made = {
        name: build_adapter(tokenizer_dir, root / name, targets=("q_proj", "v_proj"), seed=seed)
        for seed, name in enumerate(("v1", "v2", "v3", "other"), start=1)
    }
    made["r16"] = build_adapter(tokenizer_dir, root / "r16", rank=16, targets=("q_proj",), seed=9)
    return {name: str(path) for name, path in made.items()}


@pytest.fixture(scope="module")
def dirs(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_adapters(tokenizer_dir, tmp_path_factory.mktemp("adapters"))


@asynccontextmanager
async def registry(
    tokenizer_dir: Path, count: int = 2, **fields: Any
) -> AsyncIterator[tuple[FakeFleet, Fleet, Policies]]:
    settings = fields.pop("settings", {})
    async with fake_fleet(tokenizer_dir, count, max_lora_rank=16, **fields) as fakes:
        fleet = Fleet(
            [VLLMEngine(url, bound_completions=False) for url in fakes.urls],
            FleetSettings(**{"probe_interval": 60.0, "control_timeout": 5.0, **settings}),
        )
        policies = Policies(fleet)
        await fleet.start()
        try:
            yield fakes, fleet, policies
        finally:
            await policies.close()
            await fleet.close()


def expected(tokens: list[int], key: str | None, start: int = len(PROMPT)) -> list[float]:
    return [fake_logprob(start + i, token, "default", key) for i, token in enumerate(tokens)]


async def turn(fakes: FakeFleet, fleet: Fleet, policy: str | None, engine: int = 0) -> Sampled:
    for fake in fakes.engines:
        fake.queue(REPLY)
    sampled = await sample(fleet, fleet.engines[engine], PROMPT, PARAMS, policy=policy)
    for fake in fakes.engines:
        fake.replies.clear()
    return sampled


def sampled_by(sampled: Sampled, key: str | None) -> bool:
    tokens = sampled.completion.output_ids.tolist()
    return np.allclose(sampled.completion.output_logprobs, expected(tokens, key), atol=1e-6)


def model_sent(fakes: FakeFleet, sampled: Sampled) -> str:
    return fakes.by_url(sampled.engine.url).completions[-1]["model"]


async def test_a_published_version_samples_under_its_own_name_and_base_calls_stay_the_base(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, fleet, policies):
        before = await turn(fakes, fleet, None)
        assert model_sent(fakes, before) == fakes.engines[0].model_name  # no adapter anywhere: the base by name
        await policies.register("pol")
        answer = await policies.publish("pol", dirs["v1"])
        assert (answer["version"], answer["served_name"], answer["failed"]) == (1, "pol@v1", 0)
        assert [entry["ok"] for entry in answer["engines"]] == [True, True]
        for fake in fakes.engines:
            assert set(fake.adapters) == {ZERO_SERVED, "pol@v1"}
            assert adapter_key(fake.adapters[ZERO_SERVED].path) is None  # the zero adapter: the base exactly
        lora = await turn(fakes, fleet, "pol")
        assert model_sent(fakes, lora) == "pol@v1" and sampled_by(lora, adapter_key(dirs["v1"]))
        assert lora.versions == (PolicySpan(1, 0, len(REPLY) + 1, "pol"),)  # the adapter's version, not the fleet's
        base = await turn(fakes, fleet, BASE)
        assert model_sent(fakes, base) == ZERO_SERVED and sampled_by(base, None)
        assert base.versions == (PolicySpan(0, 0, len(REPLY) + 1),)
        assert base.completion.output_logprobs.tolist() == before.completion.output_logprobs.tolist()
        assert fleet.metrics.value("policy_publishes_total", policy="pol", outcome="published") == 1
        assert fleet.metrics.gauge("policy_current_version", policy="pol") == 1


async def test_an_update_leaves_the_call_in_flight_on_its_version_and_unloads_it_after(tokenizer_dir, dirs):
    async with registry(tokenizer_dir, delay=1.0) as (fakes, fleet, policies):
        await policies.register("pol", path=dirs["v1"])
        first = asyncio.ensure_future(turn(fakes, fleet, "pol"))
        await until(lambda: bool(fakes.engines[0].generating))
        view = await policies.view_one("pol")
        assert view["engines"][0]["in_use"] == {"pol@v1": 1}
        assert fleet.metrics.gauge("policy_in_use", policy="pol", served="pol@v1") == 1
        started = time.perf_counter()
        answer = await policies.publish("pol", dirs["v2"])
        assert answer["version"] == 2 and time.perf_counter() - started < 0.5  # no wait for the call in flight
        assert not first.done() and "pol@v1" in fakes.engines[0].adapters  # held: still loaded where it runs
        await until(lambda: "pol@v1" not in fakes.engines[1].adapters)  # nobody used it there: unloaded at once
        second = await turn(fakes, fleet, "pol", engine=1)
        assert model_sent(fakes, second) == "pol@v2" and sampled_by(second, adapter_key(dirs["v2"]))
        assert second.versions == (PolicySpan(2, 0, len(REPLY) + 1, "pol"),)
        done = await first
        assert sampled_by(done, adapter_key(dirs["v1"])) and done.versions == (PolicySpan(1, 0, len(REPLY) + 1, "pol"),)
        await until(lambda: all("pol@v1" not in fake.adapters for fake in fakes.engines))
        unloads = [body for path, body in fakes.engines[0].adapter_calls if path.endswith("unload_lora_adapter")]
        assert unloads == [{"lora_name": "pol@v1"}]
        assert fleet.metrics.gauge("policy_in_use", policy="pol", served="pol@v1") is None  # the label is gone


async def test_a_served_name_held_with_use_is_unloaded_only_after_it_is_released(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, fleet, policies):
        await policies.register("pol", path=dirs["v1"])
        async with policies.use("pol", fleet.engines[0]) as served:
            assert (served.model, served.version, served.policy) == ("pol@v1", 1, "pol")
            await policies.publish("pol", dirs["v2"])
            await until(lambda: "pol@v1" not in fakes.engines[1].adapters)
            await asyncio.sleep(0.2)
            assert "pol@v1" in fakes.engines[0].adapters
            async with policies.use("pol", fleet.engines[0]) as newer:
                assert newer.model == "pol@v2"  # new calls switched at once
        await until(lambda: "pol@v1" not in fakes.engines[0].adapters)
        async with policies.use(BASE, fleet.engines[1]) as base:
            assert (base.model, base.version) == (ZERO_SERVED, fleet.version)


async def test_an_engine_that_refuses_a_version_is_drained_for_that_policy_alone(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, fleet, policies):
        fakes.engines[1].max_lora_rank = 8  # this engine was started with --max-lora-rank 8
        await policies.register("small", path=dirs["v1"])
        await policies.register("big")
        answer = await policies.publish("big", dirs["r16"])
        assert answer["failed"] == 1 and [e["ok"] for e in answer["engines"]] == [True, False]
        assert "LoRA rank 16 is greater than max_lora_rank 8" in answer["engines"][1]["error"]
        assert policies.unserved("big") == {fakes.urls[1]} and policies.unserved("small") == frozenset()
        sampled = await turn(fakes, fleet, "big", engine=1)  # its session's engine is drained for it: the other one
        assert sampled.engine.url == fakes.urls[0] and model_sent(fakes, sampled) == "big@v1"
        small = await turn(fakes, fleet, "small", engine=1)
        assert small.engine.url == fakes.urls[1] and model_sent(fakes, small) == "small@v1"
        assert (await turn(fakes, fleet, BASE, engine=1)).engine.url == fakes.urls[1]
        view = await policies.view_one("big")
        assert view["engines"][1]["served_name"] is None and "max_lora_rank 8" in view["engines"][1]["drained"]
        asked = len(fakes.engines[1].adapter_calls)
        again = await policies.publish("big", dirs["r16"])  # its limit is known now: not asked again
        assert again["version"] == 2 and "--max-lora-rank 8" in again["engines"][1]["error"]
        assert len(fakes.engines[1].adapter_calls) == asked


async def test_a_publish_no_engine_takes_changes_nothing(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, _fleet, policies):
        for fake in fakes.engines:
            fake.max_lora_rank = 8
        await policies.register("pol", path=dirs["v1"])
        before = await policies.view()
        with pytest.raises(AdapterRefused, match="nothing changed") as refused:
            await policies.publish("pol", dirs["r16"])
        assert refused.value.status == 400 and all(url in refused.value.message for url in fakes.urls)
        assert await policies.view() == before and policies.unserved("pol") == frozenset()
        asked = [len(fake.adapter_calls) for fake in fakes.engines]
        with pytest.raises(AdapterRefused, match="above every engine's --max-lora-rank"):
            await policies.publish("pol", dirs["r16"])  # every engine's limit known: refused before any load
        assert [len(fake.adapter_calls) for fake in fakes.engines] == asked
        assert (await policies.publish("pol", dirs["v2"]))["version"] == 2  # the refused ones took no number
        with pytest.raises(AdapterRefused, match="no such directory"):
            await policies.publish("pol", dirs["v2"] + "-missing")
        assert (await policies.view_one("pol"))["version"] == 2


async def test_concurrent_publishes_get_one_version_each(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, fleet, policies):
        await policies.register("pol")
        await policies.register("other")
        answers = await asyncio.gather(
            policies.publish("pol", dirs["v1"]),
            policies.publish("pol", dirs["v2"]),
            policies.publish("other", dirs["other"]),
            policies.publish("pol", dirs["v3"]),
        )
        assert sorted(a["version"] for a in answers if a["policy"] == "pol") == [1, 2, 3]
        current = next(a for a in answers if a["policy"] == "pol" and a["version"] == 3)["path"]
        view = await policies.view_one("pol")
        assert view["version"] == 3 and view["path"] == current
        await until(lambda: all(set(f.adapters) == {ZERO_SERVED, "pol@v3", "other@v1"} for f in fakes.engines))
        sampled = await turn(fakes, fleet, "pol")
        assert sampled_by(sampled, adapter_key(current))


async def test_base_calls_and_other_policies_never_wait_for_a_publish(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, fleet, policies):
        await policies.register("pol", path=dirs["v1"])
        await policies.register("other", path=dirs["other"])
        for fake in fakes.engines:
            fake.load_delay = 1.5  # a slow load (a big adapter from a slow disk)
        publishing = asyncio.ensure_future(policies.publish("pol", dirs["v2"]))
        await until(lambda: all(fake.adapter_calls[-1][1].get("lora_name") == "pol@v2" for fake in fakes.engines))
        started = time.perf_counter()
        base, other, old = await asyncio.gather(
            turn(fakes, fleet, BASE), turn(fakes, fleet, "other", engine=1), turn(fakes, fleet, "pol")
        )
        assert time.perf_counter() - started < 1.0 and not publishing.done()
        assert sampled_by(base, None) and sampled_by(other, adapter_key(dirs["other"]))
        assert sampled_by(old, adapter_key(dirs["v1"])) and old.versions[0].version == 1  # v1 until v2 is there
        assert (await publishing)["version"] == 2


async def test_the_first_adapter_waits_for_base_calls_by_name_to_end(tokenizer_dir, dirs):
    """vLLM CPU applies the last LoRA slot to base-name requests batched with adapter requests: none may overlap."""
    async with registry(tokenizer_dir, count=1, delay=1.0) as (fakes, fleet, policies):
        fake = fakes.engines[0]
        by_name = asyncio.ensure_future(turn(fakes, fleet, BASE))
        await until(lambda: bool(fake.generating))
        await policies.register("pol")
        publishing = asyncio.ensure_future(policies.publish("pol", dirs["v1"]))
        await until(lambda: ZERO_SERVED in fake.adapters)
        assert "pol@v1" not in fake.adapters and fake.generating  # the base call by name still runs
        later = asyncio.ensure_future(turn(fakes, fleet, BASE))  # a base call from now names the zero adapter
        await until(lambda: len(fake.completions) == 2)
        assert fake.completions[1]["model"] == ZERO_SERVED and "pol@v1" not in fake.adapters
        first = await by_name
        await publishing
        assert first.completion.finish_reason == "stop" and "pol@v1" in fake.adapters
        assert sampled_by(first, None) and sampled_by(await later, None)


async def test_unknown_policies_and_wrong_names_are_refused_in_words(tokenizer_dir, dirs):
    async with registry(tokenizer_dir, count=1) as (fakes, fleet, policies):
        with pytest.raises(UnknownPolicy, match="no policy 'nope'") as unknown:
            await sample(fleet, fleet.engines[0], PROMPT, PARAMS, policy="nope")
        assert unknown.value.status == 404 and unknown.value.param == "policy"
        with pytest.raises(UnknownPolicy):
            await policies.publish("nope", dirs["v1"])
        for name in ("base", "", "a/b", "x" * 65, "-dash"):
            with pytest.raises(InvalidRequest):
                await policies.register(name)
        with pytest.raises(InvalidRequest, match="base model name"):
            await policies.register(fakes.engines[0].model_name)
        with pytest.raises(InvalidRequest, match="weight update"):
            await policies.publish(BASE, dirs["v1"])
        first = await policies.register("pol")
        assert await policies.register("pol") == first  # again: nothing changes
        with pytest.raises(PolicyUnavailable, match="no version yet"):
            await sample(fleet, fleet.engines[0], PROMPT, PARAMS, policy="pol")
        with pytest.raises(AdapterRefused):
            await policies.register("late", path=dirs["v1"] + "-missing")
        assert "late" not in policies.names()  # a new policy whose first publish failed is not kept


async def test_a_moe_engine_is_refused_lora_policies_in_words(tokenizer_dir, dirs):
    async with registry(tokenizer_dir) as (fakes, fleet, policies):
        fakes.engines[1].moe = FakeMoE()
        await turn(fakes, fleet, None, engine=1)  # its first call says it returns routed experts
        await policies.register("pol")
        answer = await policies.publish("pol", dirs["v1"])
        assert answer["engines"][0]["ok"] and answer["engines"][1]["error"] == MOE_REFUSAL
        assert fakes.engines[1].adapter_calls == []  # never asked: it would die on its next request
    async with registry(tokenizer_dir, count=1, moe=FakeMoE()) as (fakes, fleet, policies):
        await turn(fakes, fleet, None)
        await policies.register("pol")
        with pytest.raises(AdapterRefused, match="MoE engine"):
            await policies.publish("pol", dirs["v1"])


async def test_a_retired_policy_leaves_at_once_and_its_call_in_flight_finishes_on_its_version(tokenizer_dir, dirs):
    async with registry(tokenizer_dir, delay=1.0) as (fakes, fleet, policies):
        await policies.register("pol", path=dirs["v1"])
        await policies.register("other", path=dirs["other"])
        in_flight = asyncio.ensure_future(turn(fakes, fleet, "pol"))
        await until(lambda: bool(fakes.engines[0].generating))
        answer = await policies.retire("pol")
        assert answer == {
            "policy": "pol",
            "retired": True,
            "version": 1,
            "unloading": [{"url": url, "served_name": "pol@v1"} for url in fakes.urls],
        }
        assert policies.names() == [BASE, "other"]  # out of the registry at once
        with pytest.raises(UnknownPolicy, match="it was retired"):
            fleet.check_policy("pol")  # a new session on it (a 400 on param policy at the edge)
        with pytest.raises(PolicyRetired, match="'pol' was retired") as retired:
            await sample(fleet, fleet.engines[1], PROMPT, PARAMS, policy="pol")  # a turn of a session open on it
        assert retired.value.status == 409 and retired.value.param == "policy"
        await until(lambda: "pol@v1" not in fakes.engines[1].adapters)  # no call held it there
        assert "pol@v1" in fakes.engines[0].adapters and not in_flight.done()  # held by the call in flight
        done = await in_flight
        assert model_sent(fakes, done) == "pol@v1" and sampled_by(done, adapter_key(dirs["v1"]))
        assert done.versions == (PolicySpan(1, 0, len(REPLY) + 1, "pol"),)  # finished on its version, exactly
        await until(lambda: "pol@v1" not in fakes.engines[0].adapters)
        for fake in fakes.engines:  # the zero adapter and the other policy stay
            assert set(fake.adapters) == {ZERO_SERVED, "other@v1"}
        other = await turn(fakes, fleet, "other")
        assert sampled_by(other, adapter_key(dirs["other"]))
        assert fleet.metrics.gauge("policy_current_version", policy="pol") is None  # its series are gone
        assert fleet.metrics.gauge("policy_in_use", policy="pol", served="pol@v1") is None
        assert fleet.metrics.value("policy_publishes_total", policy="pol", outcome="published") == 0
        assert fleet.metrics.gauge("policy_current_version", policy="other") == 1


async def test_retiring_refuses_the_base_and_unknown_names_and_a_reused_name_numbers_on(tokenizer_dir, dirs):
    async with registry(tokenizer_dir, count=1) as (fakes, fleet, policies):
        with pytest.raises(InvalidRequest, match="base policy cannot be retired"):
            await policies.retire(BASE)
        with pytest.raises(UnknownPolicy, match="no policy 'nope'"):
            await policies.retire("nope")
        await policies.register("pol", path=dirs["v1"])
        await policies.publish("pol", dirs["v2"])
        assert (await policies.retire("pol"))["version"] == 2
        with pytest.raises(UnknownPolicy):
            await policies.retire("pol")  # twice: the second is unknown
        again = await policies.register("pol", path=dirs["v3"])
        assert again["version"] == 3 and again["engines"][0]["served_name"] == "pol@v3"  # numbers on after v2
        sampled = await turn(fakes, fleet, "pol")
        assert sampled_by(sampled, adapter_key(dirs["v3"])) and sampled.versions[0] == PolicySpan(3, 0, 7, "pol")
        await until(lambda: set(fakes.engines[0].adapters) == {ZERO_SERVED, "pol@v3"})
        await policies.register("bare")  # retired before any version: the next registration starts after it
        await policies.retire("bare")
        assert (await policies.register("bare", path=dirs["v1"]))["version"] == 2


async def test_retiring_one_frees_its_slot_in_the_registry(tokenizer_dir):
    async with registry(tokenizer_dir, count=1) as (_, _, policies):
        for index in range(MAX_POLICIES):
            await policies.register(f"job-{index}")
        with pytest.raises(InvalidRequest, match=f"at most {MAX_POLICIES}"):
            await policies.register("one-more")
        await policies.retire("job-7")
        await policies.register("one-more")
        assert len(policies.names()) == MAX_POLICIES + 1 and "job-7" not in policies.names()


class FailingStore(MemoryStore):
    """A shared store whose writes fail while ``down``."""

    down = False

    async def put_fleet_state(self, state: Any) -> None:
        if self.down:
            raise StoreUnavailable("the store is down")
        await super().put_fleet_state(state)


async def test_a_retirement_the_store_does_not_take_changes_nothing(tokenizer_dir, dirs):
    async with fake_fleet(tokenizer_dir, 1, max_lora_rank=16) as fakes:
        store = FailingStore()
        fleet = Fleet([VLLMEngine(url, bound_completions=False) for url in fakes.urls], FleetSettings(), shared=store)
        policies = Policies(fleet)
        await fleet.start()
        try:
            await policies.register("pol", path=dirs["v1"])
            written = await store.get_fleet_state()
            store.down = True
            with pytest.raises(StoreUnavailable):
                await policies.retire("pol")
            assert "pol" in policies.names() and await store.get_fleet_state() == written
            assert (await turn(fakes, fleet, "pol")).versions[0].policy == "pol"  # still served
            assert set(fakes.engines[0].adapters) == {ZERO_SERVED, "pol@v1"}
            store.down = False
            await policies.retire("pol")
            assert "pol" not in policies.names()
        finally:
            await policies.close()
            await fleet.close()


@asynccontextmanager
async def two_workers(
    tokenizer_dir: Path, redis_url: str, **fields: Any
) -> AsyncIterator[tuple[FakeFleet, list[Fleet], list[Policies]]]:
    """Two fleets on one Redis stand in for two workers."""
    from rollout_proxy.state.redis import RedisStore

    async with fake_fleet(tokenizer_dir, 2, max_lora_rank=16, **fields) as fakes:
        stores, fleets, registries = [], [], []
        for index in range(2):
            store = await RedisStore.connect(redis_url)
            if index == 0:
                await store._redis.flushdb()
            stores.append(store)
            fleet = Fleet(
                [VLLMEngine(url, bound_completions=False) for url in fakes.urls],
                FleetSettings(probe_interval=60.0, follow_interval=0.05),
                shared=store,
            )
            registries.append(Policies(fleet))
            await fleet.start()
            fleets.append(fleet)
        try:
            yield fakes, fleets, registries
        finally:
            for registry_, fleet in zip(registries, fleets, strict=True):
                await registry_.close()
                await fleet.close()
            for store in stores:
                await store.close()


async def test_another_worker_follows_the_policies_through_the_shared_store(tokenizer_dir, dirs, redis_url):
    """The one that publishes loads, the other switches."""
    async with two_workers(tokenizer_dir, redis_url) as (fakes, fleets, registries):
        publisher, follower = registries
        await publisher.register("pol", path=dirs["v1"])
        await until(lambda: "pol" in follower.names() and follower.unserved("pol") == frozenset())
        sampled = await turn(fakes, fleets[1], "pol")
        assert model_sent(fakes, sampled) == "pol@v1" and sampled_by(sampled, adapter_key(dirs["v1"]))
        base = await turn(fakes, fleets[1], BASE, engine=1)
        assert model_sent(fakes, base) == ZERO_SERVED and sampled_by(base, None)  # the other's zero adapter
        await publisher.publish("pol", dirs["v2"])
        async with asyncio.timeout(10):
            while [e["served_name"] for e in (await follower.view_one("pol"))["engines"]] != ["pol@v2"] * 2:  # noqa: ASYNC110 (the follower reads the store in the background)
                await asyncio.sleep(0.01)
        newer = await turn(fakes, fleets[1], "pol")
        assert model_sent(fakes, newer) == "pol@v2" and newer.versions[0].version == 2
        await until(lambda: all("pol@v1" not in fake.adapters for fake in fakes.engines))


async def test_another_worker_drops_a_retired_policy_and_keeps_one_it_just_registered(tokenizer_dir, dirs, redis_url):
    """A retirement reaches the other worker by its mark: its call in flight finishes on its version, its next turn
    is refused; a stale write that lacks a policy just registered drops nothing."""
    from rollout_proxy.engines import shared

    async with two_workers(tokenizer_dir, redis_url, delay=1.0) as (fakes, fleets, registries):
        publisher, follower = registries
        await publisher.register("pol", path=dirs["v1"])
        await until(lambda: "pol" in follower.names() and follower.unserved("pol") == frozenset())
        stale = publisher.shared()  # a write made before the registration below, landing after it
        await follower.register("fresh")
        in_flight = asyncio.ensure_future(turn(fakes, fleets[1], "pol"))  # the follower's call
        await until(lambda: any(fake.generating for fake in fakes.engines))
        await shared.publish(fleets[0], policies=stale)
        await publisher.retire("pol")
        await until(lambda: "pol" not in follower.names())
        assert "fresh" in follower.names()  # absent from a stale write: not dropped
        with pytest.raises(PolicyRetired):
            await sample(fleets[1], fleets[1].engines[0], PROMPT, PARAMS, policy="pol")
        done = await in_flight
        assert model_sent(fakes, done) == "pol@v1" and sampled_by(done, adapter_key(dirs["v1"]))
        assert done.versions == (PolicySpan(1, 0, len(REPLY) + 1, "pol"),)
        await until(lambda: all("pol@v1" not in fake.adapters for fake in fakes.engines))
        for fake in fakes.engines:  # unloaded once, by the worker that retired it; the zero adapter stays
            unloads = [body for path, body in fake.adapter_calls if path.endswith("unload_lora_adapter")]
            assert unloads == [{"lora_name": "pol@v1"}] and ZERO_SERVED in fake.adapters
        again = await follower.register("pol", path=dirs["v2"])  # the name again, on the other worker: v2
        assert again["version"] == 2
        await until(lambda: "pol" in publisher.names() and publisher.unserved("pol") == frozenset())
        assert (await publisher.view_one("pol"))["version"] == 2
        assert model_sent(fakes, await turn(fakes, fleets[0], "pol")) == "pol@v2"
        await asyncio.sleep(0.3)  # polls later: the old mark drops neither worker's new registration
        assert "pol" in publisher.names() and "pol" in follower.names()
