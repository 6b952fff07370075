"""Weight updates under load, through the admin routes and the official openai client.

Plugins keep chatting while the trainer pauses the fleet (each mode), and resumes it with a new
policy version: no call reaches an engine between the pause and the resume, the turns that
queued meanwhile are answered after it, turns an abort-mode pause cut are finished as
``--abort-policy`` says, and every trajectory's ``policy_versions`` are what the engines
reported for each token (``FakeFleet.check_trajectory``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai
import pytest

from rollout_proxy.proxy import keys
from tests.fakes import FakeFleet, fake_fleet
from tests.harness import ProxyHarness

MODES = [("keep", "continue"), ("wait", "continue"), ("abort", "continue"), ("abort", "regenerate")]


async def until(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (many tasks update what is checked; polling is simplest)
            await asyncio.sleep(0.005)


@dataclass
class Call:
    sent: float
    answered: float
    status: int


@dataclass
class Plugin:
    proxy: ProxyHarness
    index: int
    calls: list[Call] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(call.status == 200 for call in self.calls)

    async def run(self, stop: asyncio.Event, after: asyncio.Event | None = None) -> None:
        number = 0
        while not stop.is_set():
            number += 1
            history = [{"role": "user", "content": f"Plugin {self.index}, story {number}: tell me about maples."}]
            session = await self.proxy.create_session(history, max_new_tokens=40)
            if after is not None:
                await after.wait()
                after = None
            last = None
            for turn in range(3):
                sent = time.monotonic()
                try:
                    reply = await session.client.chat.completions.create(model="m", messages=history)
                except openai.APIStatusError as exc:
                    self.calls.append(Call(sent, time.monotonic(), exc.status_code))
                    break
                self.calls.append(Call(sent, time.monotonic(), 200))
                last = reply.id
                history = [*history, reply.choices[0].message.model_dump(exclude_none=True)]
                history.append({"role": "user", "content": f"More ({turn})."})
            if last is not None:
                self.finished.append(last)


@pytest.fixture
async def fakes(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 2, delay=0.4) as fleet:
        yield fleet


@pytest.mark.parametrize(("mode", "policy"), MODES, ids=[f"{m}-{p}" for m, p in MODES])
async def test_a_weight_update_under_load(fakes: FakeFleet, mode: str, policy: str):
    settings = {"abort_policy": policy, "engine_probe_interval": 0.2, "pause_wait": 60.0}
    async with ProxyHarness.running(engine_urls=fakes.urls, **settings) as proxy:
        fleet = proxy.app[keys.ENGINES]
        plugins = [Plugin(proxy, index) for index in range(8)]
        late = [Plugin(proxy, index) for index in range(8, 12)]  # their first turns come during the pause
        stop, go = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(plugin.run(stop)) for plugin in plugins]
        tasks += [asyncio.create_task(plugin.run(stop, after=go)) for plugin in late]
        plugins += late
        try:
            await until(lambda: sum(p.ok for p in plugins) >= 8)
            await until(lambda: all(any(len(g.tokens) >= 3 for g in e.generating) for e in fakes.engines))
            status, paused = await proxy.request("POST", "/v1/admin/pause", json={"mode": mode})
            assert status == 200 and paused["paused"] and paused["failed"] == 0, paused
            paused_at = time.monotonic()
            arrived = [len(engine.completions) for engine in fakes.engines]
            if mode == "wait":  # the pause answered once the calls in flight were done
                assert all(engine.inflight == 0 for engine in fakes.engines)
            go.set()
            await until(lambda: fleet.gate.waiting >= 4)  # new turns queue in the proxy
            await asyncio.sleep(0.5)
            assert [len(engine.completions) for engine in fakes.engines] == arrived  # none reached an engine
            status, resumed = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": 1})
            assert status == 200 and resumed["failed"] == 0 and not resumed["paused"], resumed
            resumed_at = time.monotonic()
            assert [engine.weight_version for engine in fakes.engines] == ["1", "1"]
            done = sum(p.ok for p in plugins)
            await until(lambda: sum(p.ok for p in plugins) >= done + 24)
        finally:
            stop.set()
            if fleet.paused:  # a failed check must not leave the plugins waiting for a resume
                await proxy.request("POST", "/v1/admin/resume", json={"policy_version": fleet.version})
            await asyncio.gather(*tasks)

        calls = [call for plugin in plugins for call in plugin.calls]
        assert {call.status for call in calls} == {200}
        queued = [call for call in calls if paused_at < call.sent < resumed_at]
        assert queued and all(call.answered > resumed_at for call in queued)  # answered after the resume
        versions = set()
        mixed = 0
        for plugin in plugins:
            for response_id in plugin.finished:
                trajectory = await proxy.trajectory(response_id)
                fakes.check_trajectory(trajectory)
                spans = trajectory["policy_versions"]
                versions |= {span["version"] for span in spans}
                mixed += sum(1 for a, b in itertools.pairwise(spans) if a["end"] == b["start"])
        assert versions == {0, 1}
        resubmitted = proxy.app[keys.METRICS].value
        if mode == "abort":
            assert resubmitted("abort_resubmissions_total", policy=policy, reason="abort") > 0
            assert (mixed > 0) == (policy == "continue")  # a continued turn: version 0 tokens, then version 1
        elif mode == "keep":
            assert resubmitted("abort_resubmissions_total", policy="regenerate", reason="weights_changed") > 0
            assert mixed == 0
        else:
            assert mixed == 0 and proxy.app[keys.METRICS].counters().get("abort_resubmissions_total", 0) == 0
        assert resubmitted("pauses_total", mode=mode) == 1 and resubmitted("resumes_total") == 1


async def test_a_stored_response_says_which_version_sampled_its_tokens(fakes: FakeFleet):
    for engine in fakes.engines:
        engine.delay = 0.0
    async with ProxyHarness.running(engine_urls=fakes.urls) as proxy:
        session = await proxy.create_session([{"role": "user", "content": "Hi"}])
        first = await session.client.responses.create(model="m", input="Hi")
        await proxy.request("POST", "/v1/admin/pause", json={"mode": "keep"})
        await proxy.request("POST", "/v1/admin/resume", json={"policy_version": 6})
        second = await session.client.responses.create(model="m", input="Again", previous_response_id=first.id)
        for response, version in ((first, 0), (second, 6)):
            status, body = await proxy.request("GET", f"/v1/responses/{response.id}", token=session.api_key)
            assert status == 200
            assert body["policy_versions"] == [{"version": version, "start": 0, "end": len(body["token_ids"])}]
        trajectory = await proxy.trajectory(second.id)
        fakes.check_trajectory(trajectory)
        assert [span["version"] for span in trajectory["policy_versions"]] == [0, 6]


async def test_a_turn_waits_for_the_resume_at_most_the_pause_wait(fakes: FakeFleet):
    async with ProxyHarness.running(engine_urls=fakes.urls, pause_wait=0.5) as proxy:
        session = await proxy.create_session([{"role": "user", "content": "Hi"}])
        await proxy.request("POST", "/v1/admin/pause", json={"mode": "abort"})
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as raised:
            await session.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        assert time.monotonic() - started >= 0.5  # it waited the pause wait out (and the answer says why)
        assert raised.value.status_code == 503 and raised.value.body["code"] == "engines_paused"
        assert int(raised.value.response.headers["Retry-After"]) >= 1
        assert all(engine.completions == [] for engine in fakes.engines)
        status, ready = await proxy.request("GET", "/readyz", token=None)
        assert status == 200 and ready["ready"]  # paused for an update: turns queue, the proxy is ready
