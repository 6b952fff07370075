"""A resent history is checked once: what a long conversation costs per turn stays what it adds.

Through the proxy (both stores, both templates): the counters of the app's ``KnownMessages`` show
what was checked, and the trajectories show that skipping the checks changed no token. Then the
memory's edges: JSON that Python calls equal but that is not the same (``1``, ``1.0``, ``true``),
a bad message after known ones, a history rewritten before the lookup window, and the bounds.
"""

from __future__ import annotations

import gc
import itertools
import tracemalloc
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.known_messages import KnownMessages, MessageIntake
from rollout_proxy.proxy.limits import load_json_object
from rollout_proxy.tokenization.messages import path_hashes
from rollout_proxy.wire.messages import normalize_messages
from tests.harness import ProxyHarness

USER = [{"role": "user", "content": "Count with me."}]


async def talk(proxy: ProxyHarness, turns: int) -> tuple[Any, list[dict[str, Any]], list[str]]:
    """A conversation of ``turns`` turns, resending its history each time: (session, history, response ids)."""
    assert proxy.fake is not None
    proxy.fake.queue(*(f"Number {turn}." for turn in range(turns)))  # distinct answers
    session = await proxy.create_session(USER)
    history, ids = list(USER), []
    for turn in range(turns):
        answer = await session.client.chat.completions.create(model="m", messages=history)
        ids.append(answer.id)
        history += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}?"}]
    return session, history, ids


async def test_a_resent_history_is_checked_once_and_the_tokens_are_the_same(proxy: ProxyHarness):
    known = proxy.app[keys.KNOWN_MESSAGES]
    _, _, ids = await talk(proxy, 12)
    # each turn checks only the two messages it adds (the first: the sample's one)
    assert known.misses == 1 + 2 * 11
    assert known.hits == sum(2 * turn - 1 for turn in range(1, 12))
    # and the openai SDK's bodies were parsed only past the history they resend, every turn after the first
    assert known.resent_bodies == 11
    trajectory = await proxy.trajectory(ids[-1])
    assert trajectory["turns"] == 12 and trajectory["forks"] == []
    # the prompt of every turn was the engine's own view of the previous one plus the bridge (no drift)
    assert proxy.fake is not None and all(
        later[: len(earlier)] == earlier
        for earlier, later in zip(proxy.fake.prompts, proxy.fake.prompts[1:], strict=False)
    )


async def test_json_python_calls_equal_is_not_taken_for_the_same_message(proxy: ProxyHarness):
    """``1 == 1.0 == True`` in Python; the messages are compared as JSON, so each is checked (and refused)."""
    session = await proxy.create_session(USER)
    status, _ = await proxy.request(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": USER}, token=session.api_key
    )
    assert status == 200
    for content in (1, 1.0, True):
        status, body = await proxy.request(
            "POST",
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": content}]},
            token=session.api_key,
        )
        assert status == 400 and body["error"]["param"] == "messages[0].content", (content, body)


async def test_a_bad_message_after_known_ones_is_refused_where_it_is(proxy: ProxyHarness):
    session, history, _ = await talk(proxy, 3)
    before = await proxy.trajectory(
        (await proxy.request("GET", f"/v1/sessions/{session.session_id}/trajectory"))[1]["response_id"]
    )
    bad = [*history[:-1], {"role": "tool", "content": "no id"}]  # a tool message needs a tool_call_id
    status, body = await proxy.request(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": bad}, token=session.api_key
    )
    assert status == 400 and body["error"]["param"].startswith(f"messages[{len(bad) - 1}]"), body
    deep = [*history, {"role": "user", "content": "x" * 10, "name": {"a": [[[[1]]]]}}]
    status, body = await proxy.request(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": deep}, token=session.api_key
    )
    assert status == 400 and body["error"]["param"].startswith(f"messages[{len(deep) - 1}]"), body
    after = await proxy.request("GET", f"/v1/sessions/{session.session_id}/trajectory")
    assert after[1]["response_id"] == before["response_id"]  # nothing was recorded


async def test_a_history_rewritten_before_the_lookup_window_still_forks(proxy: ProxyHarness):
    """The tree looks up the last few path hashes first; a rewrite further back is found all the same."""
    session, history, ids = await talk(proxy, 6)  # 12 messages: past the window of 8
    rewritten = [dict(message) for message in history]
    rewritten[1] = {"role": "assistant", "content": "Something else entirely."}
    answer = await session.client.chat.completions.create(model="m", messages=rewritten)
    trajectory = await proxy.trajectory(answer.id)
    assert trajectory["forks"] == [{"response_id": answer.id, "diverged_from": ids[0], "at_message": 1}]
    assert "Something else entirely." in proxy.fake.decode(trajectory["total_token_ids"])  # type: ignore[union-attr]


def intake_of(known: KnownMessages, messages: list[Any], session_id: str = "s") -> tuple[tuple[int, ...] | None, Any]:
    intake = MessageIntake(known)
    to_check = intake.look_up(messages, session_id=session_id)
    return to_check, intake.normalize_and_hash(messages)


@pytest.mark.parametrize("rewrite_at", [0, 3, 5])
def test_the_intake_gives_what_the_slow_path_gives(rewrite_at: int):
    known = KnownMessages()
    history = [
        {"role": "user", "content": f"m{i}"} if i % 2 == 0 else {"role": "assistant", "content": f"a{i}"}
        for i in range(6)
    ]
    intake_of(known, history)
    changed = [*history[:rewrite_at], {"role": "user", "content": "new"}, *history[rewrite_at + 1 :]]
    to_check, (normalized, hashes) = intake_of(known, changed)
    assert to_check == (rewrite_at,)
    assert normalized == normalize_messages(changed) and list(hashes) == path_hashes(normalize_messages(changed))


def test_the_memories_are_bounded():
    known = KnownMessages(max_entries=4, max_sessions=2)
    for session in range(5):
        intake_of(known, [{"role": "user", "content": f"{session}-{i}"} for i in range(3)], session_id=str(session))
    assert len(known) == 4
    assert known.last("0") is None and known.last("4") is not None


def test_of_the_conversations_a_body_resends_the_longest_is_reused():
    """A session keeps a few conversations; a body that resends two of them (one went on with the other, then
    its start was sent again) goes on from the longer, parsed and checked only past it."""
    known = KnownMessages()
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(6)]
    intake_of(known, history[:4])
    intake_of(known, history[:2])  # resends the start of the first only: kept beside it
    assert len(known.conversations("s")) == 2 and known.fresh_messages == 6
    intake = MessageIntake(known)
    payload = intake.load(orjson.dumps({"model": "m", "messages": history}), session_id="s")
    assert intake.look_up(payload["messages"], session_id="s") == (4, 5)
    normalized, hashes = intake.normalize_and_hash(payload["messages"])
    assert known.resent_bodies == 1 and known.fresh_messages == 6 + 2
    assert normalized == normalize_messages(history) and list(hashes) == path_hashes(normalized)
    # it took the place of the conversation it went on with; the shorter one stays beside it
    assert [conversation.count for conversation in known.conversations("s")] == [6, 2]


HISTORY = [{"role": "user", "content": "Count with me, é."}, {"role": "assistant", "content": 'One, "two".'}]
RESENT = b'"messages":' + orjson.dumps(HISTORY)[:-1]
#: around the resent history: what comes before the key, right after the history, and then to the end
HEADS = [b"{", b' {"model":"m",', b'{"model":"m" ,', b"{,", b'{"a":{', b'{"a":[', b'{"a":"x,', b"[", b'{"a":1,,']
HEADS += [b'{"messages":[9],', b'{"\\u006dessages":[9],', b'{"\\u0000":1,', b'{"model":"a","n":1,', b"{ "]
HEADS += [b"\t\r\n{\n", b"\x0c{", b"{\x0b", b'\xef\xbb\xbf{"model":"m",']  # JSON's whitespace, and not
FOLLOWS = [b",", b"]", b" ,", b"x", b"1", b""]
RESTS = [b"]}", b"]", b'{"role":"user","content":"3?"}]}', b'{"role":"user"}],"model":"b"}', b"]} ", b"]}x"]
RESTS += [b'],"messages":[1]}', b'],"\\u006dessages":[1]}', b'],"\\u0000":1}', b",]}", b"]]}", b'],"n":1.0}']
RESTS += [b'{"role":"user","content":"\\u0000"}]}', b'1],"model":"c","model":"d"}', b'],"a":{"messages":[]}}']
RESTS += [b'],"\\u0000":[5]}', b'{"role":"user","content":"4"},{"role":"user","content":"5"}],"model":"m"}']


def load_both(body: bytes) -> tuple[Any, Any, bool]:
    """What the intake parses for ``body`` (the session having sent ``HISTORY`` last), a whole parse, and
    whether the intake took the short way."""
    known = KnownMessages()
    intake_of(known, list(HISTORY))
    results = []
    for load in (MessageIntake(known).load, lambda body, session_id: load_json_object(body)):
        try:
            results.append(orjson.dumps(load(body, session_id="s")))  # key order and 1 / 1.0 / true kept apart
        except InvalidRequest as refused:
            results.append(refused.message)
    return results[0], results[1], known.resent_bodies == 1


def test_a_body_resending_the_history_parses_as_a_whole_parse_would():
    """The intake parses only what is around the resent history; the result (or the refusal, in its words)
    is the whole parse's, however the body around it is built: bad JSON, a key sent twice (``messages``
    too, spelled plainly or escaped), the history not at the top level, whitespace."""
    short_ways = 0
    for head, follows, rest in itertools.product(HEADS, FOLLOWS, RESTS):
        body = head + RESENT + follows + rest
        spliced, whole, short_way = load_both(body)
        assert spliced == whole, body
        short_ways += short_way
    assert short_ways >= 90  # of the 162 bodies a whole parse takes, those the intake parsed only around the history


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(HEADS) | st.binary(max_size=8), st.sampled_from(FOLLOWS), st.binary(max_size=16))
def test_noise_around_the_resent_history_parses_as_a_whole_parse_would(head: bytes, follows: bytes, rest: bytes):
    spliced, whole, _ = load_both(head + RESENT + follows + rest)
    assert spliced == whole


def test_the_history_is_parsed_once_where_the_body_resends_it():
    known = KnownMessages()
    first = intake_of(known, list(HISTORY))
    intake = MessageIntake(known)
    added = {"role": "user", "content": "3?"}
    payload = intake.load(b'{"model":"m",' + RESENT + b"," + orjson.dumps(added)[0:] + b'],"n":2}', session_id="s")
    assert payload == {"model": "m", "messages": [*HISTORY, added], "n": 2} and known.resent_bodies == 1
    last = known.last("s")
    assert last is not None and all(a is b for a, b in zip(payload["messages"], last.messages, strict=False))
    to_check = intake.look_up(payload["messages"], session_id="s")
    assert to_check == (2,)
    normalized, hashes = intake.normalize_and_hash(payload["messages"])
    assert normalized == normalize_messages(payload["messages"])
    assert list(hashes) == path_hashes(normalized) and first[1][1] == hashes[:2]
    # what it remembers is what orjson writes for the whole list: the next turn matches it again
    remembered = known.last("s")
    assert remembered is not None and remembered.encoded == orjson.dumps(payload["messages"])


# -- what the memories hold, and for how long ------------------------------------------------------


def sessions_talk(
    known: KnownMessages, sessions: int, turns: int, *, expires_at: float, name: str = "s", words: int = 30
) -> None:
    """``sessions`` conversations of ``turns`` turns (sessions ``{name}0``...), each body parsed as the proxy
    parses one; a turn adds a user message, the last assistant answer before it included."""
    for session in range(sessions):
        history: list[dict[str, Any]] = []
        for turn in range(turns):
            text = " ".join(f"{name}{session}t{turn}w{word}" for word in range(words))
            history += [{"role": "user", "content": text}]
            body = orjson.dumps({"model": "m", "messages": history})
            intake = MessageIntake(known)
            payload = intake.load(body, session_id=f"{name}{session}")
            intake.look_up(payload["messages"], session_id=f"{name}{session}", expires_at=expires_at)
            intake.normalize_and_hash(payload["messages"])
            history += [{"role": "assistant", "content": f"Answer {turn} of session {name}{session}."}]


def test_what_the_memories_count_is_what_they_hold():
    """Each memory is bounded by the bytes it counts; the count must be what its entries keep alive (as
    tracemalloc measures it), or the bound is not one. orjson's output keeps its whole buffer (4 KiB for a
    short message): kept as it came, a memo entry held ~20x what it counted."""
    known = KnownMessages()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sessions_talk(known, 40, 6, expires_at=1e12)
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    held = known.held()
    assert held["conversations"] == 40 and held["messages"] == 40 * 11
    counted = held["conversation_bytes"] + held["message_bytes"] + held["path_hash_bytes"]
    assert 0.8 * measured <= counted <= 2.5 * measured, (counted, measured)


def test_a_session_is_forgotten_when_it_finishes_and_everything_once_it_expires():
    known = KnownMessages()
    sessions_talk(known, 5, 3, expires_at=100.0)
    sessions_talk(known, 1, 2, expires_at=200.0, name="later")
    known.forget("s3")
    assert known.last("s3") is None and known.held()["conversations"] == 5
    assert known.expire(99.0) == 0
    known.expire(100.0)  # what only the first sessions sent goes; the later session's stays
    held = known.held()
    assert held["conversations"] == 1 and known.last("later0") is not None
    assert held["messages"] == 3 and held["path_hashes"] == 3
    known.expire(200.0)
    assert known.held() == {key: 0 for key in held}


def test_a_message_another_session_sends_lives_as_long_as_that_session():
    known = KnownMessages()
    shared = [{"role": "system", "content": "You are a counting assistant."}, *USER]
    for session, expires_at in (("early", 10.0), ("late", 20.0)):
        intake = MessageIntake(known)
        intake.look_up(list(shared), session_id=session, expires_at=expires_at)
        intake.normalize_and_hash(list(shared))
    assert known.hits == 2 and known.misses == 2  # the later session found both checked
    known.expire(15.0)
    assert known.last("early") is None and known.last("late") is not None and len(known) == 2
    known.expire(20.0)
    assert len(known) == 0
