"""A resent history is checked once: what a long conversation costs per turn stays what it adds.

Through the proxy (both stores, both templates): the counters of the app's ``KnownMessages`` show
what was checked, and the trajectories show that skipping the checks changed no token. Then the
memory's edges: JSON that Python calls equal but that is not the same (``1``, ``1.0``, ``true``),
a bad message after known ones, a history rewritten before the lookup window, and the bounds.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.known_messages import KnownMessages, MessageIntake
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
