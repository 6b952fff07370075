"""What the proxy keeps for a session goes with it: when it finishes, or once it has expired.

Through the app on both stores, sessions of a few turns (each with a request bound of its own)
finish or are left to expire; then the remembered conversations, the message and path-hash
memos, the verified tokens, the open-session gauge, the memory store's sessions and request
bounds and the Redis store's held paths hold nothing for them, and no metric is labelled by
session or response. Time is moved on by a clock the test holds (the app's sweep is
called with it; the memory store and the held paths read it), never waited for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from devtools.fake_engine import FakeEngine
from rollout_proxy.proxy import keys, session_memory
from rollout_proxy.state.memory import MemoryStore
from tests.conftest import TEMPLATES_DIR
from tests.harness import ProxyHarness

TTL = 60.0
TEMPLATE = str(TEMPLATES_DIR / "qwen3_style.jinja")  # as the engine runs it: the proxy renders locally


class Clock:
    """Wall time, moved on at will."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


@pytest.fixture(params=["memory", "redis"])
async def clocked_store(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, Clock]]:
    clock = Clock()
    if request.param == "memory":
        yield MemoryStore(clock=clock), clock
        return
    from rollout_proxy.state.redis import HeldPaths, RedisStore

    store = await RedisStore.connect(request.getfixturevalue("redis_url"))
    await store._redis.flushdb()
    store._paths = HeldPaths(clock=clock)  # Redis expires the keys themselves on its own clock
    yield store, clock
    await store.close()


def held(app: Any) -> dict[str, int]:
    """Entries of each per-session structure of the app."""
    store = app[keys.STORE]
    counts = {key: value for key, value in app[keys.RESENT_HISTORY].held().items() if not key.endswith("bytes")}
    counts["verified_tokens"] = len(app[keys.TOKENS])
    counts["open_sessions"] = len(app[keys.METRICS].sessions._expiry)  # held, whether or not counted since
    if isinstance(store, MemoryStore):
        counts["store_sessions"] = len(store._sessions)
        counts["request_bounds"] = len(store._limits)
    else:
        counts["held_paths"] = len(store._paths)
    return counts


async def rollout(proxy: ProxyHarness, index: int, turns: int) -> str:
    """A session with a request bound of its own, ``turns`` chat turns resending their history; its id."""
    body = {
        "sample": {"messages": [{"role": "user", "content": f"Rollout {index}: count with me."}]},
        "generation": {"max_new_tokens": 32},
        "concurrency": {"key": f"job-{index}", "max_requests": 2},
    }
    status, session = await proxy.request("POST", "/v1/sessions", json=body)
    assert status == 201, session
    client = proxy.client(session["base_url"], session["api_key"])
    history: list[dict[str, Any]] = list(body["sample"]["messages"])  # type: ignore[index]
    for turn in range(turns):
        answer = await client.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
        history += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}?"}]
    return session["session_id"]


async def harness_rollout(proxy: ProxyHarness, index: int, turns: int) -> str:
    """A session driven as Codex drives one: Responses turns resending the whole input, ``store: false``."""
    status, session = await proxy.request(
        "POST", "/v1/sessions", json={"sample": {}, "generation": {"max_new_tokens": 32}}
    )
    assert status == 201, session
    client = proxy.client(session["base_url"], session["api_key"])
    items: list[dict[str, Any]] = [{"role": "user", "content": f"Harness {index}: count with me."}]
    for turn in range(turns):
        answer = await client.responses.create(model="m", input=items, store=False)  # type: ignore[arg-type]
        items += [{"role": "assistant", "content": answer.output_text}, {"role": "user", "content": f"{turn}?"}]
    return session["session_id"]


async def finish(proxy: ProxyHarness, session_id: str) -> None:
    status, body = await proxy.request("POST", f"/v1/sessions/{session_id}/finish", json={"status": "success"})
    assert status == 200, body


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_what_a_session_leaves_goes_when_it_finishes_or_expires(
    fake_engine: FakeEngine, clocked_store: tuple[Any, Clock]
):
    store, clock = clocked_store
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url], store=store, fake=fake_engine, session_ttl=TTL, chat_template=TEMPLATE
    ) as proxy:
        app = proxy.app
        ids = [await rollout(proxy, index, 3) for index in range(8)]
        harnessed = [await harness_rollout(proxy, index, 3) for index in range(2)]
        assert held(app)["conversations"] == 8 + 2  # each session's chat messages, or its Responses input
        await finish(proxy, harnessed[0])
        assert held(app)["conversations"] == 8 + 1  # a finish forgets the session's input
        await finish(proxy, ids[0])
        during = held(app)
        assert during["conversations"] == 7 + 1 and during["verified_tokens"] == 10 and during["open_sessions"] == 8
        assert during.get("request_bounds", 0) == 0  # a bound lives while a turn holds or waits for its slot
        for session_id in ids[1:4]:
            await finish(proxy, session_id)
        finished = held(app)
        assert finished["conversations"] == 4 + 1 and finished["open_sessions"] == 5
        assert finished.get("held_paths", 5) == 5  # a finish drops its session's held path
        # the metrics label by route template, status, engine, outcome: never by session or response
        labels = {str(value) for key in app[keys.METRICS]._children for _, value in key[1:]}
        assert not {label for label in labels if "sess_" in label or "resp_" in label}, labels

        clock.ahead = TTL + 1  # every session has expired
        session_memory.expire(app, clock())
        if isinstance(store, MemoryStore):
            store.expire()
        else:
            store._paths.expire()
        after = held(app)
        assert after == dict.fromkeys(after, 0), after


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_expired_sessions_leave_nothing_without_a_metrics_scrape_or_traffic(
    fake_engine: FakeEngine, clocked_store: tuple[Any, Clock]
):
    """The app's own timer sweeps (``session_memory.SWEEP_EVERY``): nobody scrapes /metrics, nothing else is sent."""
    store, _ = clocked_store
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url], store=store, fake=fake_engine, session_ttl=2, chat_template=TEMPLATE
    ) as proxy:
        for index in range(3):
            await rollout(proxy, index, 2)
        assert held(proxy.app)["conversations"] == 3
        for _ in range(50):  # polled: the sweeps are the app's own (2 s of TTL, a sweep a second)
            if not any(held(proxy.app).values()):
                break
            await asyncio.sleep(0.2)
        counts = held(proxy.app)
        assert counts == dict.fromkeys(counts, 0), counts


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_freed_memory_is_given_back_once_every_session_has_gone(
    fake_engine: FakeEngine, clocked_store: tuple[Any, Clock]
):
    """Once nothing is kept for any session (and stays so a while), the freed memory is handed back, once;
    not while sessions are kept, and again only after more sessions came and went."""
    store, clock = clocked_store
    released: list[float] = []

    def release() -> bool:
        released.append(clock())
        return True

    async with ProxyHarness.running(
        engine_urls=[fake_engine.url], store=store, fake=fake_engine, session_ttl=TTL, chat_template=TEMPLATE
    ) as proxy:
        sweeper = asyncio.create_task(
            session_memory.sweep_forever(proxy.app, every=0.02, quiet=0.1, release=release, clock=clock)
        )
        try:
            await rollout(proxy, 0, 2)
            await asyncio.sleep(0.3)
            assert released == []  # a session is kept
            clock.ahead = TTL + 1
            await asyncio.sleep(0.3)
            assert len(released) == 1 and session_memory.held(proxy.app) == 0
            await asyncio.sleep(0.3)
            assert len(released) == 1  # nothing new came and went
            clock.ahead = 0.0
            await rollout(proxy, 1, 1)
            clock.ahead = TTL + 1
            await asyncio.sleep(0.3)
            assert len(released) == 2
        finally:
            sweeper.cancel()


def test_releasing_free_memory_works_on_this_system():
    assert session_memory.release_free_memory() is True  # glibc: malloc_trim is there
