"""A resent history is taken in once (``proxy.resent_history``): what a long conversation costs per turn
stays what it adds, over the three APIs' lists.

Chat ``messages`` through the proxy (both stores, both templates): the counters of the app's
``ResentHistory`` show what was checked, and the trajectories show that skipping the checks changed no
token. Then the memory's edges: JSON that Python calls equal but that is not the same (``1``, ``1.0``,
``true``), a bad message after known ones, a history rewritten before the lookup window, a body parsed
only around the history it resends, and the bounds. Then Responses' ``input`` (Codex resends it whole)
and the Messages API's ``messages`` (Claude Code resends them, moving its ``cache_control`` marks to the
newest message each turn): checked, folded and keyed only past what the session sent; the result, or the
refusal, is a whole check's.
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_proxy.errors import InvalidRequest
from rollout_proxy.proxy import keys
from rollout_proxy.proxy.limits import MAX_STRING_CHARS, load_json_object
from rollout_proxy.proxy.resent_history import ResentHistory
from rollout_proxy.tokenization.messages import canonical_key, path_hashes
from rollout_proxy.wire.anthropic import Conversation, conversation
from rollout_proxy.wire.messages import MessageFold, normalize_messages
from rollout_proxy.wire.responses import InputFold, input_to_messages
from tests.harness import ProxyHarness, store_snapshot

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
    known = proxy.app[keys.RESENT_HISTORY]
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


def intake_of(
    known: ResentHistory, messages: list[Any], session_id: str = "s", expires_at: float = 0.0
) -> tuple[tuple[int, ...] | None, Any]:
    """A chat request's ``messages`` taken in as the intake takes them (its session open)."""
    intake = known.intake("chat", "messages", session_id, expires_at=expires_at)
    to_check = intake.look_up(messages)
    folded = intake.take(messages, MessageFold)
    intake.commit()
    return to_check, (folded.fold.messages, tuple(folded.hashes))


@pytest.mark.parametrize("rewrite_at", [0, 3, 5])
def test_the_intake_gives_what_the_slow_path_gives(rewrite_at: int):
    known = ResentHistory()
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
    known = ResentHistory(max_items=4, max_sessions=2)
    for session in range(5):
        intake_of(known, [{"role": "user", "content": f"{session}-{i}"} for i in range(3)], session_id=str(session))
    assert known.held()["messages"] == 4 and known.held()["conversations"] == 2
    assert known.last("chat", "0") is None and known.last("chat", "4") is not None


def test_of_the_conversations_a_body_resends_the_longest_is_reused():
    """A session keeps a few conversations; a body that resends two of them (one went on with the other, then
    its start was sent again) goes on from the longer, parsed and checked only past it."""
    known = ResentHistory()
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(6)]
    intake_of(known, history[:4])
    intake_of(known, history[:2])  # resends the start of the first only (nothing new): kept beside it
    assert len(known.lists("chat", "s")) == 2 and known.fresh_items == 4
    intake = known.intake("chat", "messages", "s")
    payload = intake.load(orjson.dumps({"model": "m", "messages": history}))
    assert intake.look_up(payload["messages"]) == (4, 5)
    folded = intake.take(payload["messages"], MessageFold)
    intake.commit()
    assert known.resent_bodies == 1 and known.fresh_items == 4 + 2
    assert folded.fold.messages == normalize_messages(history) and folded.hashes == path_hashes(folded.fold.messages)
    # it took the place of the conversation it went on with; the shorter one stays beside it
    assert [len(kept.items) for kept in known.lists("chat", "s")] == [6, 2]


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
    known = ResentHistory()
    intake_of(known, list(HISTORY))
    results = []
    for load in (known.intake("chat", "messages", "s").load, load_json_object):
        try:
            results.append(orjson.dumps(load(body)))  # key order and 1 / 1.0 / true kept apart
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
    known = ResentHistory()
    first = intake_of(known, list(HISTORY))
    intake = known.intake("chat", "messages", "s")
    added = {"role": "user", "content": "3?"}
    payload = intake.load(b'{"model":"m",' + RESENT + b"," + orjson.dumps(added)[0:] + b'],"n":2}')
    assert payload == {"model": "m", "messages": [*HISTORY, added], "n": 2} and known.resent_bodies == 1
    last = known.last("chat", "s")
    assert last is not None and all(a is b for a, b in zip(payload["messages"], last.items, strict=False))
    to_check = intake.look_up(payload["messages"])
    assert to_check == (2,)
    folded = intake.take(payload["messages"], MessageFold)
    assert folded.fold.messages == normalize_messages(payload["messages"])
    assert folded.hashes == path_hashes(folded.fold.messages) and first[1][1] == tuple(folded.hashes[:2])
    assert known.last("chat", "s") is last  # nothing remembered before the request is taken in whole
    intake.commit()
    # what it remembers is what orjson writes for the whole list: the next turn matches it again
    remembered = known.last("chat", "s")
    assert remembered is not None and remembered.encoded == orjson.dumps(payload["messages"])
    assert [remembered.encoded[: end + 1] for end in remembered.offsets[:-1]] == [
        orjson.dumps(payload["messages"][:count])[:-1] + b"," for count in (1, 2)
    ]


# -- what the memories hold, and for how long ------------------------------------------------------


def sessions_talk(
    known: ResentHistory, sessions: int, turns: int, *, expires_at: float, name: str = "s", words: int = 30
) -> None:
    """``sessions`` conversations of ``turns`` turns (sessions ``{name}0``...), each body parsed as the proxy
    parses one; a turn adds a user message, the last assistant answer before it included."""
    for session in range(sessions):
        history: list[dict[str, Any]] = []
        for turn in range(turns):
            text = " ".join(f"{name}{session}t{turn}w{word}" for word in range(words))
            history += [{"role": "user", "content": text}]
            body = orjson.dumps({"model": "m", "messages": history})
            intake = known.intake("chat", "messages", f"{name}{session}", expires_at=expires_at)
            payload = intake.load(body)
            intake.look_up(payload["messages"])
            intake.take(payload["messages"], MessageFold)
            intake.commit()
            history += [{"role": "assistant", "content": f"Answer {turn} of session {name}{session}."}]


def test_what_the_memories_count_is_what_they_hold():
    """Each memory is bounded by the bytes it counts; the count must be what its entries keep alive (as
    tracemalloc measures it), or the bound is not one. orjson's output keeps its whole buffer (4 KiB for a
    short message): kept as it came, a memo entry held ~20x what it counted."""
    known = ResentHistory()
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
    known = ResentHistory()
    sessions_talk(known, 5, 3, expires_at=100.0)
    sessions_talk(known, 1, 2, expires_at=200.0, name="later")
    known.forget("s3")
    assert known.last("chat", "s3") is None and known.held()["conversations"] == 5
    assert known.expire(99.0) == 0
    known.expire(100.0)  # what only the first sessions sent goes; the later session's stays
    held = known.held()
    assert held["conversations"] == 1 and known.last("chat", "later0") is not None
    assert held["messages"] == 3 and held["path_hashes"] == 3
    known.expire(200.0)
    assert known.held() == {key: 0 for key in held}


def test_a_message_another_session_sends_lives_as_long_as_that_session():
    known = ResentHistory()
    shared = [{"role": "system", "content": "You are a counting assistant."}, *USER]
    for session, expires_at in (("early", 10.0), ("late", 20.0)):
        intake_of(known, list(shared), session_id=session, expires_at=expires_at)
    assert known.hits == 2 and known.misses == 2  # the later session found both checked
    known.expire(15.0)
    assert known.last("chat", "early") is None and known.last("chat", "late") is not None
    assert known.held()["messages"] == 2
    known.expire(20.0)
    assert known.held()["messages"] == 0


# -- Responses' input and the Messages API's messages ------------------------------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "codex-0.171.0"


def codex_turn(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(json.loads((FIXTURES / name).read_text())["body"]["input"])


FIRST = codex_turn("responses-turn1.json")
SECOND = codex_turn("responses-turn2-after-tool-call.json")  # FIRST, then reasoning, a call, its output


def folded(known: ResentHistory, items: list[Any], session_id: str = "s") -> tuple[tuple[int, ...] | None, Any]:
    intake = known.intake("responses", "input", session_id)
    to_check = intake.look_up(items)
    taken = intake.take(items, InputFold)
    intake.commit()
    return to_check, (taken.fold.messages, taken.keys)


def whole(items: list[Any]) -> tuple[list[dict[str, Any]], list[bytes]]:
    messages = input_to_messages(items)
    return messages, [canonical_key(message) for message in messages]


def test_a_resent_input_is_checked_only_past_the_last_one():
    known = ResentHistory()
    to_check, first = folded(known, FIRST)
    assert to_check == tuple(range(len(FIRST))) and first == whole(FIRST)
    to_check, second = folded(known, SECOND)
    assert to_check == tuple(range(len(FIRST), len(SECOND))) and known.resent == 1
    assert second == whole(SECOND)


def test_a_call_joins_the_remembered_assistant_message_without_changing_it():
    """The fold goes on from the last turn's: a function_call after a resent assistant message joins a copy."""
    known = ResentHistory()
    start = [
        {"role": "user", "content": "Hi."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
    ]
    call = {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}
    _, before = folded(known, start)
    remembered = known.last("responses", "s")
    assert remembered is not None
    _, after = folded(known, [*start, call, output])
    assert after == whole([*start, call, output])
    assert before == whole(start)  # what the first turn answered is not changed by the second
    assert "tool_calls" not in remembered.fold.messages[-1]  # nor what was remembered of it
    _, again = folded(known, [*start, call, output])  # the same input once more: everything reused
    assert again == whole([*start, call, output])


@pytest.mark.parametrize(
    ("change", "changed_from"),
    [
        (lambda items: items[0]["content"][0].update(text="A rewritten developer prompt."), 0),  # rewritten
        (lambda items: items.pop(2), 2),  # an item dropped
        (lambda items: items[1].update(id="msg_other"), 1),  # the same message, other bytes
    ],
)
def test_an_input_that_does_not_resend_the_last_one_is_checked_from_its_first_change_and_folded_whole(
    change, changed_from
):
    """Each item's check is its own, so the leading items equal to the last input's, and any item sent before,
    are not checked again; but a Responses fold cannot go on from the middle (a later call may join an earlier message): folded
    whole."""
    known = ResentHistory()
    folded(known, FIRST)
    items = codex_turn("responses-turn2-after-tool-call.json")
    change(items)
    to_check, result = folded(known, items)
    sent = {orjson.dumps(item) for item in FIRST}  # the items checked before (in any list) are not again
    expected = tuple(index for index in range(changed_from, len(items)) if orjson.dumps(items[index]) not in sent)
    assert to_check == expected and known.resent == 0
    assert result == whole(items)


def test_sessions_are_bounded():
    known = ResentHistory(max_sessions=2)
    for session_id in ("a", "b", "c"):
        folded(known, FIRST, session_id)
    assert (
        known.held()["conversations"] == 2
        and known.last("responses", "a") is None
        and known.last("responses", "c") is not None
    )


def test_a_list_resending_only_the_start_of_the_main_one_is_kept_beside_it():
    """A side call that resends the main conversation's developer prompt and asks something else shares its
    start, and is shorter: kept beside the main list, which the main's next turn goes on from."""
    known = ResentHistory()
    folded(known, FIRST)
    side = [*FIRST[:1], {"role": "user", "content": "Write a title for this task."}]
    to_check, result = folded(known, side)
    assert to_check == (1,) and result == whole(side)
    fresh = known.fresh_items
    to_check, second = folded(known, SECOND)
    assert to_check == tuple(range(len(FIRST), len(SECOND))) and second == whole(SECOND)
    assert known.fresh_items - fresh == len(SECOND) - len(FIRST) and known.held()["conversations"] == 2


def test_a_session_keeps_its_last_lists_and_forgets_them_all_at_its_finish():
    known = ResentHistory()
    for name in ("first", "second", "third"):
        folded(known, [{"role": "developer", "content": f"You are the {name} agent."}, *FIRST[1:]])
    folded(known, FIRST, session_id="other")
    assert known.held()["conversations"] == 4 and len(known.lists("responses", "s")) == 3
    known.forget("s")
    assert known.held()["conversations"] == 1 and known.lists("responses", "s") == ()


CLAUDE_SYSTEM = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]


def claude_turns() -> list[list[dict[str, Any]]]:
    """Messages as Claude Code resends them: each turn moves its cache_control mark to the newest message."""
    user = {"role": "user", "content": [{"type": "text", "text": "List the files."}]}
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls"}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]}
    answer = {"role": "assistant", "content": [{"type": "text", "text": "One file: a.txt."}]}
    follow = {"role": "user", "content": [{"type": "text", "text": "And its size?"}]}
    turns = [[user], [user, call, result], [user, call, result, answer, follow]]
    for history in turns:
        history[:] = copy.deepcopy(history)
        history[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return turns


def messages_folded(known: ResentHistory, items: list[Any], system: Any = CLAUDE_SYSTEM):
    intake = known.intake("messages", "messages", "s")
    to_check = intake.look_up(items)
    taken = intake.take(items, lambda: Conversation.starting(system), context=json.dumps(system).encode())
    intake.commit()
    return to_check, taken.fold, taken.keys


def test_messages_whose_cache_marks_moved_are_folded_from_the_first_changed_one():
    known = ResentHistory()
    first, second, third = claude_turns()
    messages_folded(known, first)
    to_check, fold, message_keys = messages_folded(known, second)
    assert to_check == (0, 1, 2)  # the first message lost its cache mark: other bytes from the first on
    to_check, fold, message_keys = messages_folded(known, third)
    assert to_check == (2, 3, 4) and known.resent == 1  # the first two are the last turn's, byte for byte
    expected = conversation(CLAUDE_SYSTEM, third)
    assert fold.messages == expected.messages and fold.signed == expected.signed
    assert message_keys == [canonical_key(message) for message in expected.messages]


def test_a_side_call_under_another_system_prompt_leaves_the_main_conversation_its_fold():
    """Claude Code's summary request resends the conversation under its own system prompt, and adds to it:
    its items are not checked again, but it is folded whole (another ``system``), and it is kept beside the
    main conversation, whose next turn is folded from the main's own fold."""
    known = ResentHistory()
    first, second, third = claude_turns()
    messages_folded(known, first)
    messages_folded(known, second)
    summary = [*copy.deepcopy(second), {"role": "user", "content": [{"type": "text", "text": "Summarize."}]}]
    del summary[-2]["content"][-1]["cache_control"]
    summarizer = [{"type": "text", "text": "You summarize conversations."}]
    to_check, fold, _ = messages_folded(known, summary, system=summarizer)
    assert to_check == (2, 3) and fold.messages == conversation(summarizer, summary).messages
    resent, fresh = known.resent, known.fresh_items
    to_check, fold, _ = messages_folded(known, third)
    assert to_check == (3, 4)  # the summary's unmarked third message is byte for byte this one's
    assert known.resent == resent + 1 and known.fresh_items - fresh == 3  # folded on from the main's two
    assert fold.messages == conversation(CLAUDE_SYSTEM, third).messages


def test_another_system_prompt_folds_the_messages_whole():
    known = ResentHistory()
    _, second, third = claude_turns()
    messages_folded(known, second)
    other = [{"type": "text", "text": "You are someone else."}]
    _, fold, _ = messages_folded(known, third, system=other)
    assert fold.messages == conversation(other, third).messages


# -- through the proxy --------------------------------------------------------------------------------


async def test_a_bad_item_after_the_resent_ones_is_refused_naming_it(proxy: ProxyHarness):
    session = await proxy.create_session([])
    first = [{"role": "user", "content": "Say hi."}]
    status, body = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": first, "store": False}, token=session.api_key
    )
    assert status == 200, body
    echoed = [*first, *body["output"], {"role": "user", "content": "Again."}]
    status, body = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": echoed, "store": False}, token=session.api_key
    )
    assert status == 200, body
    assert proxy.app[keys.RESENT_HISTORY].resent == 1
    before = await store_snapshot(proxy.app[keys.STORE])
    bad = [*echoed, *body["output"], {"type": "image", "url": "x"}]
    status, refused = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": bad, "store": False}, token=session.api_key
    )
    assert status == 400 and refused["error"]["param"] == f"input[{len(bad) - 1}].type", refused
    too_long = [*echoed, *body["output"], {"role": "user", "content": "x" * (MAX_STRING_CHARS + 1)}]
    status, refused = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": too_long, "store": False}, token=session.api_key
    )
    assert status == 400 and refused["error"]["param"] == f"input[{len(too_long) - 1}].content", refused
    assert await store_snapshot(proxy.app[keys.STORE]) == before


def test_an_item_another_api_checked_is_checked_again():
    """The APIs' shapes differ (a Responses message item needs its content, a chat message need not): the
    item memo vouches for an item only within the API that checked it."""
    known = ResentHistory()
    item = {"role": "assistant"}
    intake_of(known, [item])
    assert known.intake("chat", "messages", "other").look_up([item]) == ()
    assert known.intake("responses", "input", "s").look_up([item]) == (0,)


async def test_a_body_is_remembered_only_once_its_session_is_checked_open(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    memory = proxy.app[keys.RESENT_HISTORY]
    await session.client.chat.completions.create(model="m", messages=USER)
    assert memory.last("chat", session.session_id) is not None
    status, _ = await proxy.request("POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "success"})
    assert status == 200 and memory.last("chat", session.session_id) is None  # a finish forgets it
    held = memory.held()
    status, body = await proxy.request(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": [*USER, *USER]}, token=session.api_key
    )
    assert status == 409, body
    assert memory.last("chat", session.session_id) is None and memory.held() == held  # nothing of it kept
