"""LoRA policies on a real vLLM (CPU, fp32, ``--enable-lora``): updates under calls in flight and under load.

One server for every test here (``dense_lora``; a start costs one to three minutes on 2 cores). What they show:

- on the fleet alone: a call on v1 in flight while v2 is published finishes exactly as v1 alone would have (the
  same tokens), the next call is v2's, v1 is unloaded afterwards, each adapter samples other tokens than the
  base, and base calls through the zero adapter are the base's (the vLLM CPU batching bug it avoids);
- through the proxy, multi-turn sessions on several policies at once while adapters publish: every turn
  answered, no pause, and every sampled token's recorded (policy, version) is the served name of the engine
  call that sampled it, read from what vLLM was asked (a relay keeps every call);
- two jobs on two adapters of the one engine, both publishing: neither's tokens are the other's, and
  ``/metrics`` counts turns and tokens per policy.

The names differ per test (``pol``, ``upd``, ``job-a`` ...): each test has its own proxy, and the adapters an
earlier one left loaded stay on the shared server.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.lora_adapter import build_adapter
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.fleet import Fleet, FleetSettings
from rollout_proxy.engines.policies import BASE, ZERO_SERVED, Policies, served_name
from rollout_proxy.engines.sampling import Sampled, sample
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness
from tests.integration.conftest import RecordingRelay, VLLMServers
from tests.proxy.test_policy_sessions import owners

ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
LONG = SamplingParams(max_tokens=40, temperature=1.0, top_p=1.0, top_k=0, seed=1234)
SHORT = SamplingParams(max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, seed=1234)


def tokens(sampled: Sampled) -> list[int]:
    return sampled.completion.output_ids.tolist()


async def test_an_adapter_update_under_a_call_in_flight(vllm_servers: VLLMServers, tmp_path: Path, tokenizer_dir):
    server = vllm_servers.get("dense_lora")
    v1 = str(build_adapter(tokenizer_dir, tmp_path / "v1", targets=("q_proj", "v_proj"), seed=1, std=0.05))
    v2 = str(build_adapter(tokenizer_dir, tmp_path / "v2", targets=("q_proj", "v_proj"), seed=2, std=0.05))
    engine = VLLMEngine(server.base_url, bound_completions=False)
    fleet = Fleet([engine], FleetSettings(probe_interval=60.0, control_timeout=120.0))
    policies = Policies(fleet)
    await fleet.start()
    try:
        prompt = await engine.tokenize_messages(ASK, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
        base = await sample(fleet, engine, prompt, LONG)
        await policies.register("pol", path=v1)
        assert {card.name for card in await engine.adapters()} == {ZERO_SERVED, "pol@v1"}
        alone = await sample(fleet, engine, prompt, LONG, policy="pol")
        assert tokens(alone) != tokens(base)  # the adapter changes what is sampled

        in_flight = asyncio.ensure_future(sample(fleet, engine, prompt, LONG, policy="pol"))
        await asyncio.sleep(1.0)
        started = time.perf_counter()
        published = await policies.publish("pol", v2)
        publish_seconds = time.perf_counter() - started
        assert published["version"] == 2 and published["failed"] == 0
        assert not in_flight.done()  # the update did not wait for it
        newer = await sample(fleet, engine, prompt, SHORT, policy="pol")
        assert newer.versions[0].version == 2 and tokens(newer) != tokens(alone)[: len(tokens(newer))]
        old = await in_flight
        assert old.versions[0].version == 1 and old.completion.finish_reason == "length"
        assert tokens(old) == tokens(alone)  # unchanged by the update under it
        np.testing.assert_allclose(old.completion.output_logprobs, alone.completion.output_logprobs, atol=1e-4)
        async with asyncio.timeout(30):
            while "pol@v1" in {card.name for card in await engine.adapters()}:  # noqa: ASYNC110
                await asyncio.sleep(0.1)

        through_zero = await sample(fleet, engine, prompt, LONG)
        assert tokens(through_zero) == tokens(base)  # the base, through the zero adapter
        np.testing.assert_allclose(through_zero.completion.output_logprobs, base.completion.output_logprobs, atol=1e-4)
        print(f"\n[lora] publish under load: {publish_seconds:.2f}s")
    finally:
        await policies.close()
        await fleet.close()


# -- through the proxy: sessions on other policies while one publishes, two jobs' adapters at once ----------------

#: each session's turns are short (a turn is a few seconds on 2 shared cores) and sampled (temperature 1)
GENERATION = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
TURNS = 3


@dataclass
class Turn:
    policy: str
    started: float
    ended: float


@dataclass
class Load:
    """Sessions chatting through the proxy, one conversation after another per worker, until stopped."""

    proxy: ProxyHarness
    turns: list[Turn] = field(default_factory=list)
    leaves: list[tuple[str, str]] = field(default_factory=list)  # (policy, the last response id of a conversation)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    conversations: itertools.count = field(default_factory=itertools.count)
    answered: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def until(self, answered: Callable[[list[Turn]], bool]) -> None:
        """Until the turns answered so far (every worker's) are ``answered``."""
        async with self.answered:
            await self.answered.wait_for(lambda: answered(self.turns))

    async def worker(self, policy: str) -> None:
        while not self.stop.is_set():
            number = next(self.conversations)  # every conversation's prompt is its own: calls are told apart by it
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": f"Conversation {number}: name a colour of the rainbow."}
            ]
            session = await self.proxy.create_session(messages, policy=policy, **GENERATION)
            for turn in range(TURNS):
                started = time.perf_counter()
                answer = await session.client.chat.completions.create(model="m", messages=messages)
                self.turns.append(Turn(policy, started, time.perf_counter()))
                async with self.answered:
                    self.answered.notify_all()
                text = answer.choices[0].message.content or ""
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then? ({turn})"}]
            self.leaves.append((policy, answer.id))

    @classmethod
    @asynccontextmanager
    async def running(cls, proxy: ProxyHarness, workers: dict[str, int]) -> AsyncIterator[Load]:
        """``workers``: sessions at once per policy. Stopped on exit: each worker ends its conversation."""
        load = cls(proxy)
        tasks = [asyncio.ensure_future(load.worker(policy)) for policy, n in workers.items() for _ in range(n)]
        try:
            yield load
            load.stop.set()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


@pytest.fixture
async def lora_proxy(vllm_servers: VLLMServers) -> AsyncIterator[tuple[ProxyHarness, RecordingRelay]]:
    """The proxy in front of the LoRA vLLM, through a relay that keeps every call (the served name it asked)."""
    server = vllm_servers.get("dense_lora")
    async with (
        RecordingRelay.serving(server.base_url) as relay,
        # probes get 5 s: vLLM's API server answers late while it generates on two shared cores
        ProxyHarness.running(engine_urls=[relay.url], engine_health_timeout=5.0) as proxy,
    ):
        yield proxy, relay


async def publish(proxy: ProxyHarness, name: str, path: Path) -> int:
    """Register ``name`` with ``path`` as version 1, or publish ``path`` as its next version."""
    route, body = (
        ("/v1/admin/policies", {"name": name, "path": str(path)})
        if name not in proxy.app[keys.POLICIES].names()
        else (f"/v1/admin/policies/{name}/versions", {"path": str(path)})
    )
    status, answer = await proxy.request("POST", route, json=body)
    assert status == 200 and not answer.get("failed"), answer
    return int(answer["version"])


def engine_calls(relay: RecordingRelay) -> dict[tuple[int, ...], list[tuple[str, list[int], list[float]]]]:
    """vLLM's generate calls by prompt: (the served name asked for, the tokens and logprobs vLLM sampled)."""
    calls: dict[tuple[int, ...], list[tuple[str, list[int], list[float]]]] = collections.defaultdict(list)
    for request, response in relay.completions:
        choice = response["choices"][0]
        calls[tuple(choice["prompt_token_ids"])].append(
            (request["model"], choice["token_ids"], choice["logprobs"]["token_logprobs"])
        )
    return calls


@dataclass
class Attribution:
    """Every sampled token of the trajectories against the engine call that sampled it."""

    tokens: int = 0
    misattributed: int = 0
    seen: dict[str, set[tuple[str, int]]] = field(default_factory=lambda: collections.defaultdict(set))
    crossing: int = 0  # trajectories of a LoRA policy sampled by more than one of its versions

    def check(self, policy: str, trajectory: dict[str, Any], calls) -> None:
        ids, weights, logprobs = (
            trajectory[k] for k in ("total_token_ids", "total_loss_weight", "total_token_logprobs")
        )
        owner = owners(trajectory)
        sampled = [i for i, weight in enumerate(weights) if weight > 0]
        versions: set[tuple[str, int]] = set()
        for run in runs(sampled):  # one turn's output: the call whose prompt is everything before it
            start, end = run[0], run[-1] + 1
            [(model, _, engine_logprobs)] = [c for c in calls[tuple(ids[:start])] if c[1] == ids[start:end]]
            assert logprobs[start:end] == engine_logprobs  # that call's tokens, as vLLM reported them
            for index in run:
                said = owner.get(index)
                self.tokens += 1
                if said is None:  # a sampled token in no span
                    self.misattributed += 1
                    continue
                versions.add(said)
                self.misattributed += said[0] != policy or served(*said) != model
        self.seen[policy] |= versions
        self.crossing += policy != BASE and len(versions) > 1


def runs(indices: list[int]) -> list[list[int]]:
    """Consecutive indices grouped: each group one turn's sampled tokens."""
    groups: list[list[int]] = []
    for index in indices:
        if groups and groups[-1][-1] == index - 1:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def served(policy: str, version: int) -> str:
    """The served name a call of this (policy, version) names on an engine that serves adapters."""
    return ZERO_SERVED if policy == BASE else served_name(policy, version)


async def attribution(proxy: ProxyHarness, relay: RecordingRelay, load: Load) -> Attribution:
    calls, checked = engine_calls(relay), Attribution()
    for policy, leaf in load.leaves:
        checked.check(policy, await proxy.trajectory(leaf), calls)
    return checked


async def loaded(proxy: ProxyHarness) -> set[str]:
    [member] = proxy.app[keys.ENGINES].members.values()
    return {card.name for card in await member.client.adapters()}


async def until_unloaded(proxy: ProxyHarness, names: set[str]) -> None:
    async with asyncio.timeout(60):
        while await loaded(proxy) & names:  # noqa: ASYNC110
            await asyncio.sleep(0.2)


def latencies(turns: list[Turn], policy: str, within: Callable[[Turn], bool]) -> dict[str, float]:
    seconds = sorted(turn.ended - turn.started for turn in turns if turn.policy == policy and within(turn))
    if not seconds:
        return {"turns": 0}
    return {"turns": len(seconds), "p50_s": round(statistics.median(seconds), 2), "max_s": round(seconds[-1], 2)}


async def test_sessions_on_other_policies_run_on_through_adapter_updates_with_every_token_attributed(
    lora_proxy: tuple[ProxyHarness, RecordingRelay], tokenizer_dir, tmp_path: Path
):
    """Two sessions at once on each of ``upd`` (published 3 more times), ``other`` (another adapter) and the base,
    multi-turn, through the proxy: every turn answered, the fleet never paused, every sampled token's (policy,
    version) the served name its engine call asked for (0 misattributed), the old versions unloaded."""
    proxy, relay = lora_proxy
    fleet = proxy.app[keys.ENGINES]
    dirs = {
        name: build_adapter(tokenizer_dir, tmp_path / name, targets=("q_proj", "v_proj"), seed=seed, std=0.05)
        for seed, name in enumerate(("upd1", "upd2", "upd3", "upd4", "other1"), start=11)
    }
    assert await publish(proxy, "upd", dirs["upd1"]) == 1
    assert await publish(proxy, "other", dirs["other1"]) == 1
    paused_seen: list[bool] = []

    async def watch_pause() -> None:
        while True:
            paused_seen.append(fleet.paused or fleet.gate.waiting > 0)
            await asyncio.sleep(0.01)

    watcher = asyncio.ensure_future(watch_pause())
    publishes: list[tuple[float, float]] = []
    try:
        async with Load.running(proxy, {"upd": 2, "other": 2, BASE: 2}) as load:
            await load.until(lambda turns: len(turns) >= 18)  # a quiet window first: the same load, no update
            for version in (2, 3, 4):
                started = time.perf_counter()
                assert await publish(proxy, "upd", dirs[f"upd{version}"]) == version
                publishes.append((started, time.perf_counter()))
                # the next one once a call of upd sent after this one is answered (calls on the one before are
                # still in flight then): every version samples, on a slow machine as on a fast one
                await load.until(
                    lambda turns, after=started: any(t.policy == "upd" and t.started > after for t in turns)
                )
    finally:
        watcher.cancel()

    assert load.turns and len(load.leaves) == len(load.turns) // TURNS  # every turn answered (a failure raises)
    assert paused_seen and not any(paused_seen)  # no pause, no turn held at the gate
    checked = await attribution(proxy, relay, load)
    assert checked.tokens > 0 and checked.misattributed == 0
    assert checked.seen["other"] == {("other", 1)} and {p for p, _ in checked.seen[BASE]} == {BASE}
    assert {v for _, v in checked.seen["upd"]} == {1, 2, 3, 4} and checked.crossing > 0  # conversations span updates
    await until_unloaded(proxy, {"upd@v1", "upd@v2", "upd@v3"})
    assert {"upd@v4", "other@v1", ZERO_SERVED} <= await loaded(proxy)

    first, last = publishes[0][0], publishes[-1][1]
    quiet = {policy: latencies(load.turns, policy, lambda t: t.ended < first) for policy in ("other", BASE)}
    during = {
        policy: latencies(load.turns, policy, lambda t: t.ended > first and t.started < last)
        for policy in ("other", BASE)
    }
    print(
        "\n[lora update under load] "
        + json.dumps(
            {
                "publish_s": [round(end - start, 3) for start, end in publishes],
                "quiet": quiet,
                "during_updates": during,
                "tokens_checked": checked.tokens,
                "misattributed": checked.misattributed,
                "upd_versions_sampled": sorted(v for _, v in checked.seen["upd"]),
            }
        )
    )


async def test_two_jobs_on_two_adapters_of_one_engine_each_publish_and_keep_their_own_tokens(
    lora_proxy: tuple[ProxyHarness, RecordingRelay], tokenizer_dir, tmp_path: Path
):
    """Two jobs' sessions on ``job-a`` and ``job-b`` (adapters of the one base, on the one engine) while both
    publish new versions at once: no token is attributed to the other job's adapter, each job's tokens are its
    own versions', and /metrics counts each policy's turns and tokens apart."""
    proxy, relay = lora_proxy
    jobs = ("job-a", "job-b")
    dirs = {
        (job, version): build_adapter(
            tokenizer_dir, tmp_path / f"{job}-{version}", targets=("q_proj", "v_proj"), seed=seed, std=0.05
        )
        for seed, (job, version) in enumerate(itertools.product(jobs, (1, 2, 3)), start=21)
    }
    for job in jobs:
        assert await publish(proxy, job, dirs[job, 1]) == 1
    async with Load.running(proxy, dict.fromkeys(jobs, 2)) as load:
        for version in (2, 3):
            await load.until(lambda turns, enough=4 * version: len(turns) >= enough)
            published = await asyncio.gather(*(publish(proxy, job, dirs[job, version]) for job in jobs))
            assert published == [version, version]

    checked = await attribution(proxy, relay, load)
    assert checked.tokens > 0 and checked.misattributed == 0
    for job in jobs:
        assert {policy for policy, _ in checked.seen[job]} == {job}  # never the other job's adapter
        assert {version for _, version in checked.seen[job]} >= {1, 3}
    await until_unloaded(proxy, {f"{job}@v{version}" for job in jobs for version in (1, 2)})

    status, text = await proxy.request("GET", "/metrics", token=None)
    assert status == 200
    samples = {
        (sample.name, sample.labels.get("policy")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    generated = collections.Counter(request["model"].split("@")[0] for request, _ in relay.completions)
    for job in jobs:
        turns = sum(turn.policy == job for turn in load.turns)
        tokens = sum(
            len(response["choices"][0]["token_ids"])
            for request, response in relay.completions
            if request["model"].startswith(f"{job}@")
        )
        assert generated[job] == turns  # one engine call per turn
        assert samples["rollout_proxy_policy_turns_total", job] == turns
        assert samples["rollout_proxy_policy_generated_tokens_total", job] == tokens
    assert ("rollout_proxy_policy_turns_total", BASE) not in samples or samples[
        "rollout_proxy_policy_turns_total", BASE
    ] == 0
