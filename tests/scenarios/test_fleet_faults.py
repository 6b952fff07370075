"""The proxy over three fake engines with faults, through the official openai client.

One engine killed under 16 concurrent sessions: no turn fails and every trajectory is still
exactly what the engines were sent and returned. A hung engine: its turns fail over within
the call timeout. A restarted engine: no turn until its version is set. Removing an engine
drains it. And the admin routes that show and change the fleet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai
import pytest

from rollout_proxy.engines.health import EngineState
from rollout_proxy.proxy import keys
from tests.fakes import FakeFleet, fake_fleet
from tests.harness import ProxyHarness

FAST = {"engine_probe_interval": 0.1, "engine_backoff_max": 0.5}


async def until(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (many tasks update what is checked; polling is simplest)
            await asyncio.sleep(0.01)


@dataclass
class Plugin:
    """One rollout plugin: sessions of chat turns (its own messages), each extending the last answer."""

    proxy: ProxyHarness
    index: int
    turns_per_session: int = 3
    ok: int = 0
    failures: list[tuple[int, object]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # the last response id of every chain

    async def run(self, stop: asyncio.Event) -> None:
        number = 0
        while not stop.is_set():
            number += 1
            history = [{"role": "user", "content": f"Plugin {self.index}, story {number}: tell me about rivers."}]
            session = await self.proxy.create_session(history, max_new_tokens=24)
            last = None
            for turn in range(self.turns_per_session):
                started = time.monotonic()
                try:
                    reply = await session.client.chat.completions.create(model="m", messages=history)
                except openai.APIStatusError as exc:
                    self.failures.append((exc.status_code, exc.body))
                    break
                self.latencies.append(time.monotonic() - started)
                self.ok += 1
                last = reply.id
                history = [*history, reply.choices[0].message.model_dump(exclude_none=True)]
                history.append({"role": "user", "content": f"And then? ({turn})"})
            if last is not None:
                self.finished.append(last)


@pytest.fixture
async def fakes(tokenizer_dir):
    async with fake_fleet(tokenizer_dir, 3, delay=0.03) as fleet:
        yield fleet


async def check_every_trajectory(proxy: ProxyHarness, fakes: FakeFleet, plugins: list[Plugin]) -> int:
    count = 0
    for plugin in plugins:
        for response_id in plugin.finished:
            fakes.check_trajectory(await proxy.trajectory(response_id))
            count += 1
    return count


async def test_an_engine_killed_under_16_sessions_fails_no_turn_and_every_trajectory_stays_exact(fakes: FakeFleet):
    async with ProxyHarness.running(engine_urls=fakes.urls, **FAST) as proxy:
        plugins = [Plugin(proxy, index) for index in range(16)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(plugin.run(stop)) for plugin in plugins]
        try:
            await until(lambda: sum(p.ok for p in plugins) >= 48)
            await until(lambda: fakes.engines[0].inflight > 0)  # kill it with calls in flight
            await fakes.kill(0)
            killed_at = sum(p.ok for p in plugins)
            await until(lambda: sum(p.ok for p in plugins) >= killed_at + 96)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert [failure for plugin in plugins for failure in plugin.failures] == []
        fleet = proxy.app[keys.ENGINES]
        assert fleet.members[fakes.urls[0]].state is EngineState.UNHEALTHY
        assert await check_every_trajectory(proxy, fakes, plugins) >= 16
        _, metrics = await proxy.request("GET", "/v1/admin/counters")
        assert metrics["engine_failovers_total"] > 0  # sessions of the dead engine moved


async def test_a_hung_engine_fails_over_within_the_call_timeout(fakes: FakeFleet):
    async with ProxyHarness.running(engine_urls=fakes.urls, engine_timeout=1.0, **FAST) as proxy:
        fakes.engines[1].set_fault("hang")  # /health answers, completions never do
        plugins = [Plugin(proxy, index) for index in range(6)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(plugin.run(stop)) for plugin in plugins]
        try:
            await until(lambda: sum(p.ok for p in plugins) >= 36)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert [failure for plugin in plugins for failure in plugin.failures] == []
        assert max(latency for plugin in plugins for latency in plugin.latencies) < 1.0 + 2.0
        assert fakes.engines[1].completions  # it was tried, and its turns went elsewhere
        await check_every_trajectory(proxy, fakes, plugins)


async def test_a_restarted_engine_gets_no_turn_until_its_version_is_set(fakes: FakeFleet):
    for engine in fakes.engines:
        engine.weight_version = "4"
    async with ProxyHarness.running(engine_urls=fakes.urls, **FAST) as proxy:
        await fakes.kill(2)
        await fakes.restart(2)  # back with "default" weights: version 0, not the fleet's 4
        await until(lambda: proxy.app[keys.ENGINES].members[fakes.urls[2]].state is EngineState.STALE)
        status, view = await proxy.request("GET", "/v1/admin/engines")
        assert status == 200 and view["policy_version"] == 4
        entry = view["engines"][2]
        assert entry["state"] == "stale" and entry["policy_version"] == 0 and "version 0" in entry["last_error"]
        plugins = [Plugin(proxy, index) for index in range(4)]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(plugin.run(stop)) for plugin in plugins]
        await until(lambda: sum(p.ok for p in plugins) >= 24)
        assert fakes.engines[2].completions == []
        status, entry = await proxy.request(
            "POST", "/v1/admin/engines", json={"url": fakes.urls[2], "policy_version": 4}
        )
        assert status == 200 and entry["state"] == "healthy" and entry["policy_version"] == 4
        assert fakes.engines[2].weight_version == "4"
        await until(lambda: len(fakes.engines[2].completions) > 0)  # new sessions reach it now
        stop.set()
        await asyncio.gather(*tasks)
        assert [failure for plugin in plugins for failure in plugin.failures] == []


async def test_removing_an_engine_drains_it(fakes: FakeFleet):
    fakes.engines[0].delay = 1.0
    async with ProxyHarness.running(engine_urls=fakes.urls[:2], **FAST) as proxy:
        fleet = proxy.app[keys.ENGINES]
        history = [{"role": "user", "content": "A long answer, please."}]
        for _ in range(4):  # a session on the slow engine (new sessions take the engines in turn)
            session = await proxy.create_session(history, max_new_tokens=24)
            _, record = await proxy.request("GET", f"/v1/sessions/{session.session_id}")
            if record["engine"] == fakes.urls[0]:
                break
        assert record["engine"] == fakes.urls[0]
        in_flight = asyncio.create_task(session.client.chat.completions.create(model="m", messages=history))
        await until(lambda: fakes.engines[0].inflight == 1)
        status, entry = await proxy.request("DELETE", f"/v1/admin/engines?url={fakes.urls[0]}")
        assert status == 200 and entry["state"] == "draining" and entry["in_flight"] == 1
        other = await proxy.create_session(history, max_new_tokens=24)
        await other.client.chat.completions.create(model="m", messages=history)
        assert len(fakes.engines[0].completions) == 1  # nothing new went to the draining engine
        reply = await in_flight
        assert reply.choices[0].finish_reason in ("stop", "length")  # the call in flight finished there
        await until(lambda: fakes.urls[0] not in fleet.members)
        status, view = await proxy.request("GET", "/v1/admin/engines")
        assert [entry["url"] for entry in view["engines"]] == [fakes.urls[1]]
        again = await session.client.chat.completions.create(model="m", messages=history)  # its session moves
        assert again.id and len(fakes.engines[0].completions) == 1


async def test_the_fleet_routes_are_the_admins_and_check_what_they_are_sent(fakes: FakeFleet):
    async with ProxyHarness.running(engine_urls=fakes.urls[:1], **FAST) as proxy:
        session = await proxy.create_session([{"role": "user", "content": "Hi"}])
        for method, path, body in [
            ("GET", "/v1/admin/engines", None),
            ("POST", "/v1/admin/engines", {"url": fakes.urls[1]}),
            ("DELETE", f"/v1/admin/engines?url={fakes.urls[0]}", None),
            ("POST", "/v1/admin/pause", {"mode": "keep"}),
            ("POST", "/v1/admin/resume", {"policy_version": 1}),
        ]:
            for token in (None, session.api_key):
                status, answer = await proxy.request(method, path, json=body, token=token)
                assert status == 401 and answer["error"]["type"] == "authentication_error", (method, path, token)
        assert len(proxy.app[keys.ENGINES].members) == 1 and not proxy.app[keys.ENGINES].paused
        for body, param in [
            ({"url": "ftp://engine:8000"}, "url"),
            ({"url": "http://engine:8000?x=1"}, "url"),
            ({"url": "http://engine:99999"}, "url"),
            ({"url": fakes.urls[1], "policy_version": -1}, "policy_version"),
            ({"url": fakes.urls[1], "extra": 1}, "extra"),
        ]:
            status, answer = await proxy.request("POST", "/v1/admin/engines", json=body)
            assert status == 400 and answer["error"]["param"] == param, (body, answer)
        status, answer = await proxy.request("POST", "/v1/admin/pause", json={"mode": "bogus"})
        assert status == 400 and answer["error"]["param"] == "mode"
        status, answer = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": "3"})
        assert status == 400 and answer["error"]["param"] == "policy_version"
        status, answer = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": 3})
        assert status == 409 and answer["error"]["code"] == "conflict"
        status, answer = await proxy.request("DELETE", "/v1/admin/engines?url=http://nowhere:1")
        assert status == 404 and answer["error"]["param"] == "url"
        status, answer = await proxy.request("DELETE", "/v1/admin/engines")
        assert status == 400 and answer["error"]["param"] == "url"
        assert len(proxy.app[keys.ENGINES].members) == 1 and not proxy.app[keys.ENGINES].paused

        status, entry = await proxy.request("POST", "/v1/admin/engines", json={"url": fakes.urls[1] + "/"})
        assert status == 200 and entry == {
            "url": fakes.urls[1],
            "state": "healthy",
            "policy_version": 0,
            "in_flight": 0,
            "last_error": None,
        }
        status, view = await proxy.request("GET", "/v1/admin/engines")
        assert view["policy_version"] == 0 and view["paused"] is False
        assert [entry["url"] for entry in view["engines"]] == fakes.urls[:2]
        status, ready = await proxy.request("GET", "/readyz")
        assert status == 200 and ready["engines"] == {
            "healthy": 2,
            "total": 2,
            "urls": {fakes.urls[0]: True, fakes.urls[1]: True},
        }
        metrics = proxy.app[keys.METRICS].render()
        assert 'rollout_proxy_engines{state="healthy"} 2' in metrics
        assert 'rollout_proxy_engines{state="unhealthy"} 0' in metrics
        assert "rollout_proxy_policy_version 0" in metrics


async def test_when_every_engine_hangs_the_client_gets_an_error_within_the_deadline(fakes: FakeFleet):
    async with ProxyHarness.running(engine_urls=fakes.urls[:2], engine_timeout=1.0, **FAST) as proxy:
        session = await proxy.create_session([{"role": "user", "content": "Hi"}])
        for fake in fakes.engines[:2]:
            fake.set_fault("hang")  # /health answers, completions never do
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as raised:
            await session.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        took = time.monotonic() - started
        assert raised.value.status_code == 504 and raised.value.body["code"] == "engine_timeout"
        assert int(raised.value.response.headers["Retry-After"]) >= 1
        assert 1.0 <= took < 2 * 1.0 + 3.0  # one call timeout per engine tried, never unbounded
        assert all(len(fake.completions) == 1 for fake in fakes.engines[:2])  # each tried once
        assert proxy.app[keys.METRICS].value("engine_retries_total") == 1


async def test_a_full_pause_queue_answers_503_with_retry_after_and_the_queued_turn_is_answered_after_resume(
    fakes: FakeFleet,
):
    async with ProxyHarness.running(engine_urls=fakes.urls[:1], pause_queue=1, **FAST) as proxy:
        history = [{"role": "user", "content": "Hi"}]
        first = await proxy.create_session(history)
        second = await proxy.create_session(history)
        status, _ = await proxy.request("POST", "/v1/admin/pause", json={"mode": "keep"})
        assert status == 200
        queued = asyncio.create_task(first.client.chat.completions.create(model="m", messages=history))
        await until(lambda: proxy.app[keys.ENGINES].gate.waiting == 1)
        with pytest.raises(openai.APIStatusError) as raised:
            await second.client.chat.completions.create(model="m", messages=history)
        assert raised.value.status_code == 503 and raised.value.body["code"] == "engines_paused"
        assert int(raised.value.response.headers["Retry-After"]) >= 1
        assert fakes.engines[0].completions == []
        metrics = proxy.app[keys.METRICS].render()
        assert "rollout_proxy_paused_turns 1" in metrics and "rollout_proxy_engines_paused 1" in metrics
        status, _ = await proxy.request("POST", "/v1/admin/resume", json={"policy_version": 2})
        assert status == 200
        reply = await queued
        assert reply.choices[0].finish_reason in ("stop", "length") and len(fakes.engines[0].completions) == 1
        metrics = proxy.app[keys.METRICS].render()
        assert "rollout_proxy_paused_turns 0" in metrics and "rollout_proxy_pause_seconds_total" in metrics
