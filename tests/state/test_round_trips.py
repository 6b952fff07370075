"""A turn costs at most two Redis round trips: one read (the session, its engine, the path-index
entries and the parent's path, in one script) and one write (the node, its index entries and the
session's engine move, in one script).

A session with a job's request bound (``request_concurrency``) costs the same: its token names the
bound, so the slot is taken in the read's pipeline and given back in the write's. Its slot comes back
on every path (a turn refused after the read, an engine failure); a token without the claim (an older
proxy's) takes the slot around the engine call as before, at two round trips more.

Counted where redis-py puts bytes on the wire (``send_packed_command``: one call per command, or
per pipeline), so a command added to the hot path anywhere fails this test. Only the request's own
tasks count (those started since the count began): the proxy's background loops (the shared fleet
state's poll) run on their own clock, not per turn. Nor does the handshake of a connection the pool
opens (HELLO, CLIENT SETINFO, a health check's PING): redis-py sends it once per connection, and a turn
that happens to need one more (the fleet poll holds the other) pays it once, not per turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.connection import Connection

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.proxy import keys as app_keys
from rollout_proxy.state import keys
from rollout_proxy.state.redis import RedisStore
from rollout_proxy.state.store import RequestBound
from tests.conftest import TEMPLATES
from tests.harness import ProxyHarness

USER = [{"role": "user", "content": "Tell me a story."}]
MAX_ROUND_TRIPS = 2
# what redis-py sends on its own: a new connection's handshake, a health check's ping
CONNECTION_UPKEEP = frozenset({b"HELLO", b"AUTH", b"CLIENT", b"SELECT", b"PING", b"READONLY"})


def command_name(command: bytes | list[bytes]) -> bytes:
    """The first command's name in a packed (RESP) command, as redis-py hands it to the socket."""
    packed = bytes(command[0]) if isinstance(command, list) else bytes(command)
    # b"*<argc>\r\n$<len>\r\n<NAME>\r\n..."
    return packed.split(b"\r\n", 3)[2].upper()


class Sends:
    """Round trips to Redis made by this process's tasks started since ``reset``."""

    def __init__(self) -> None:
        self.count = 0
        self.background: set[asyncio.Task[Any]] = set()

    def reset(self) -> None:
        self.count = 0
        self.background = asyncio.all_tasks()


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sends]:
    counter = Sends()
    original = Connection.send_packed_command

    async def counted(self: Connection, command: bytes | list[bytes], check_health: bool = True) -> None:
        if asyncio.current_task() not in counter.background and command_name(command) not in CONNECTION_UPKEEP:
            counter.count += 1
        await original(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counted)
    yield counter


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisStore]:
    store = await RedisStore.connect(redis_url)
    await store._redis.flushdb()
    yield store
    await store.close()


@pytest.fixture
async def proxy(tokenizer_dir: Path, store: RedisStore) -> AsyncIterator[ProxyHarness]:
    """A proxy on ``store`` (a cluster's, where this module's tests are collected again) and a fake engine."""
    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    async with (
        FakeEngineServer(engine) as url,
        ProxyHarness.running(engine_urls=[url], store=store, fake=engine) as harness,
    ):
        yield harness


def fake(proxy: ProxyHarness) -> FakeEngine:
    assert proxy.fake is not None
    return proxy.fake


async def bounded_session(proxy: ProxyHarness, job: str, limit: int) -> dict[str, Any]:
    """A session of a job with ``request_concurrency`` ``limit``, as the runner creates them."""
    body = {"sample": {"messages": USER}, "concurrency": {"key": job, "max_requests": limit}}
    status, created = await proxy.request("POST", "/v1/sessions", json=body)
    assert status == 201, created
    return created


async def held(store: RedisStore, job: str) -> int:
    """Slots of ``job``'s bound held now."""
    return int(await store._redis.zcard(keys.request_leases_key(job)))


async def all_given_back(store: RedisStore, job: str) -> bool:
    """Whether every slot of ``job`` comes back (a failed turn's at its request's end: soon, not at once)."""
    async with asyncio.timeout(5):  # generous: the give-back is one command after the answer
        while await held(store, job):  # noqa: ASYNC110 (given back by the proxy in the background)
            await asyncio.sleep(0.01)
    return True


async def test_chat_turns_make_at_most_two_redis_round_trips(proxy: ProxyHarness, sends: Sends) -> None:
    session = await proxy.create_session(USER)
    messages = list(USER)
    per_turn, seen = [], []
    for turn in range(4):
        sends.reset()
        status, body = await proxy.request(
            "POST", "/v1/chat/completions", json={"messages": messages}, token=session.api_key
        )
        assert status == 200, body
        per_turn.append(sends.count)
        seen.append(body["prompt_token_ids"] + body["choices"][0]["token_ids"])
        if turn:  # attached under the last turn, token-exactly (the read-ahead found the right parent)
            assert body["prompt_token_ids"][: len(seen[-2])] == seen[-2]
        reply = body["choices"][0]["message"]
        messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": f"and {turn}?"}]
    # the first turn may load the scripts into a server that has not seen them (once per server)
    assert min(per_turn[1:]) >= 1 and max(per_turn[1:]) <= MAX_ROUND_TRIPS, per_turn


async def test_responses_turns_after_a_previous_response_make_at_most_two_round_trips(
    proxy: ProxyHarness, sends: Sends
) -> None:
    session = await proxy.create_session(USER)
    status, body = await proxy.request("POST", "/v1/responses", json={"input": USER}, token=session.api_key)
    assert status == 200, body
    per_turn = []
    for turn in range(3):
        sends.reset()
        status, body = await proxy.request(
            "POST",
            "/v1/responses",
            json={"input": f"and {turn}?", "previous_response_id": body["id"]},
            token=session.api_key,
        )
        assert status == 200, body
        per_turn.append(sends.count)
    assert min(per_turn) >= 1 and max(per_turn) <= MAX_ROUND_TRIPS, per_turn


async def test_responses_turns_resending_their_input_make_at_most_two_round_trips(
    proxy: ProxyHarness, sends: Sends
) -> None:
    """As Codex sends them (``store: false``, the whole input again each turn, no ``previous_response_id``):
    the read ahead takes the path-index entries and the parent's path with the session, no second read."""
    session = await proxy.create_session(USER)
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": USER[0]["content"]}]
    per_turn, seen = [], []
    for turn in range(4):
        sends.reset()
        status, body = await proxy.request(
            "POST", "/v1/responses", json={"input": items, "store": False}, token=session.api_key
        )
        assert status == 200, body
        per_turn.append(sends.count)
        tokens = body["prompt_token_ids"] + body["token_ids"]
        if turn:  # attached under the last turn, token-exactly
            assert tokens[: len(seen[-1])] == seen[-1]
        seen.append(tokens)
        items += [*body["output"], {"type": "message", "role": "user", "content": f"and {turn}?"}]
    assert min(per_turn[1:]) >= 1 and max(per_turn[1:]) <= MAX_ROUND_TRIPS, per_turn


async def test_a_turn_on_a_new_connection_counts_its_commands_not_the_handshake(
    proxy: ProxyHarness, store: RedisStore, sends: Sends
) -> None:
    """The pool's connections closed: the turn opens one (a handshake of several commands) and still
    counts the same two round trips, so the bound above holds whenever the pool grows."""
    session = await proxy.create_session(USER)
    per_turn = []
    for _ in range(2):
        await store._redis.connection_pool.disconnect()
        sends.reset()
        status, body = await proxy.request(
            "POST", "/v1/chat/completions", json={"messages": USER}, token=session.api_key
        )
        assert status == 200, body
        per_turn.append(sends.count)
    assert per_turn[-1] == MAX_ROUND_TRIPS, per_turn


async def test_turns_of_a_session_with_a_request_bound_make_at_most_two_round_trips(
    proxy: ProxyHarness, store: RedisStore, sends: Sends
) -> None:
    session = await bounded_session(proxy, "job-rt", 4)
    messages = list(USER)
    per_turn = []
    for turn in range(4):
        sends.reset()
        status, body = await proxy.request(
            "POST", "/v1/chat/completions", json={"messages": messages}, token=session["api_key"]
        )
        assert status == 200, body
        per_turn.append(sends.count)
        assert await held(store, "job-rt") == 0  # given back with the node write
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
        messages += [{"role": "user", "content": f"and {turn}?"}]
    assert min(per_turn[1:]) >= 1 and max(per_turn[1:]) <= MAX_ROUND_TRIPS, per_turn


async def test_a_slot_taken_with_the_read_bounds_the_engine_calls(proxy: ProxyHarness, store: RedisStore) -> None:
    engine = fake(proxy)
    engine.delay = 0.2
    tokens = [(await bounded_session(proxy, "job-one", 1))["api_key"] for _ in range(3)]
    answers = await asyncio.gather(
        *(proxy.request("POST", "/v1/chat/completions", json={"messages": USER}, token=token) for token in tokens)
    )
    assert [status for status, _ in answers] == [200, 200, 200], answers
    assert len(engine.completions) == 3
    assert engine.max_inflight == 1
    assert await held(store, "job-one") == 0


async def test_a_turn_waits_for_a_slot_of_a_full_bound(proxy: ProxyHarness, store: RedisStore) -> None:
    """Full at the read: nothing is taken with it, and the turn polls for a slot as before."""
    session = await bounded_session(proxy, "job-full", 1)
    leases = keys.request_leases_key("job-full")
    assert await store._try_slot(leases, "another-proxys-turn", 1, 0.5)  # a holder that never gives it back
    status, body = await proxy.request(
        "POST", "/v1/chat/completions", json={"messages": USER}, token=session["api_key"]
    )
    assert status == 200, body  # once the other's lease ran out
    assert await held(store, "job-full") == 0


async def test_a_slot_comes_back_when_the_turn_fails(proxy: ProxyHarness, store: RedisStore) -> None:
    session = await bounded_session(proxy, "job-fail", 2)
    fake(proxy).set_fault("error")
    status, body = await proxy.request(
        "POST", "/v1/chat/completions", json={"messages": USER}, token=session["api_key"]
    )
    assert status >= 500 and body["error"]["message"], body
    assert await all_given_back(store, "job-fail")


async def test_a_slot_comes_back_when_the_request_is_refused_after_the_read(
    proxy: ProxyHarness, store: RedisStore
) -> None:
    session = await bounded_session(proxy, "job-refused", 2)
    token = session["api_key"]
    too_long = [{"role": "user", "content": "hello " * 3000}]  # over the engine's 2,048: refused before it is called
    status, body = await proxy.request("POST", "/v1/chat/completions", json={"messages": too_long}, token=token)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert await all_given_back(store, "job-refused")
    status, body = await proxy.request(
        "POST", f"/v1/sessions/{session['session_id']}/finish", json={"status": "failure", "responses": []}
    )
    assert status == 200, body
    status, body = await proxy.request("POST", "/v1/chat/completions", json={"messages": USER}, token=token)
    assert status == 409, body  # refused at the read: its slot goes back at once
    assert await all_given_back(store, "job-refused")


async def test_a_token_without_the_bound_claim_still_works(
    proxy: ProxyHarness, store: RedisStore, sends: Sends
) -> None:
    """An older proxy's token: the slot is taken and given back around the engine call, as before."""
    session = await bounded_session(proxy, "job-old", 1)
    old_token = proxy.app[app_keys.TOKENS].issue(session["session_id"], session["expires_at"])
    status, body = await proxy.request("POST", "/v1/chat/completions", json={"messages": USER}, token=old_token)
    assert status == 200, body
    sends.reset()
    messages = [*USER, {"role": "assistant", "content": body["choices"][0]["message"]["content"]}]
    status, body = await proxy.request(
        "POST",
        "/v1/chat/completions",
        json={"messages": [*messages, {"role": "user", "content": "more"}]},
        token=old_token,
    )
    assert status == 200, body
    assert sends.count <= MAX_ROUND_TRIPS + 2, sends.count
    assert await held(store, "job-old") == 0


async def test_a_streamed_turn_of_a_session_with_a_request_bound_makes_at_most_two_round_trips(
    proxy: ProxyHarness, store: RedisStore, sends: Sends
) -> None:
    """The engine call runs in a task of its own while the turn streams: it uses the slot taken with the read."""
    session = await bounded_session(proxy, "job-stream", 2)
    client = proxy.client(session["base_url"], session["api_key"])
    messages: list[Any] = list(USER)
    per_turn = []
    for turn in range(3):
        sends.reset()
        stream = await client.chat.completions.create(model="policy", messages=messages, stream=True)
        reply = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        per_turn.append(sends.count)
        assert await held(store, "job-stream") == 0
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and {turn}?"}]
    assert min(per_turn[1:]) >= 1 and max(per_turn[1:]) <= MAX_ROUND_TRIPS, per_turn


async def test_the_session_record_not_the_token_decides_the_bound(proxy: ProxyHarness, store: RedisStore) -> None:
    """A token naming another bound than its session's (never minted so): that slot goes back at the read, and
    the turn takes its session's own at the engine call."""
    session = await bounded_session(proxy, "job-real", 1)
    other = RequestBound("job-other", 1)
    token = proxy.app[app_keys.TOKENS].issue(session["session_id"], session["expires_at"], bound=other)
    status, body = await proxy.request("POST", "/v1/chat/completions", json={"messages": USER}, token=token)
    assert status == 200, body
    assert await held(store, "job-other") == 0 and await held(store, "job-real") == 0
