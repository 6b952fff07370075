"""A resent list is checked, folded and keyed only past what the session sent last (``proxy.known_input``):
Responses' ``input`` (Codex resends it whole) and the Messages API's ``messages`` (Claude Code resends them,
moving its ``cache_control`` marks to the newest message each turn); the result, or the refusal, is a whole
check's."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.known_input import KnownInputs, ListIntake
from rollout_proxy.tokenization.messages import canonical_key
from rollout_proxy.wire.anthropic import Conversation, conversation
from rollout_proxy.wire.responses import InputFold, input_to_messages
from tests.harness import ProxyHarness, store_snapshot

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "codex-0.171.0"


def codex_turn(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(json.loads((FIXTURES / name).read_text())["body"]["input"])


FIRST = codex_turn("responses-turn1.json")
SECOND = codex_turn("responses-turn2-after-tool-call.json")  # FIRST, then reasoning, a call, its output


def folded(known: KnownInputs, items: list[Any], session_id: str = "s") -> tuple[tuple[int, ...] | None, Any]:
    intake = ListIntake(known, api="responses", key="input")
    to_check = intake.look_up(items, session_id=session_id)
    fold, message_keys = intake.fold(items, InputFold)
    return to_check, (fold.messages, message_keys)


def whole(items: list[Any]) -> tuple[list[dict[str, Any]], list[bytes]]:
    messages = input_to_messages(items)
    return messages, [canonical_key(message) for message in messages]


def test_a_resent_input_is_checked_only_past_the_last_one():
    known = KnownInputs()
    to_check, first = folded(known, FIRST)
    assert to_check == tuple(range(len(FIRST))) and first == whole(FIRST)
    to_check, second = folded(known, SECOND)
    assert to_check == tuple(range(len(FIRST), len(SECOND))) and known.resent == 1
    assert second == whole(SECOND)


def test_a_call_joins_the_remembered_assistant_message_without_changing_it():
    """The fold goes on from the last turn's: a function_call after a resent assistant message joins a copy."""
    known = KnownInputs()
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
    """Each item's check is its own, so the leading items equal to the last input's are not checked again;
    but a Responses fold cannot go on from the middle (a later call may join an earlier message): folded
    whole."""
    known = KnownInputs()
    folded(known, FIRST)
    items = codex_turn("responses-turn2-after-tool-call.json")
    change(items)
    to_check, result = folded(known, items)
    assert to_check == tuple(range(changed_from, len(items))) and known.resent == 0
    assert result == whole(items)


def test_sessions_are_bounded():
    known = KnownInputs(max_sessions=2)
    for session_id in ("a", "b", "c"):
        folded(known, FIRST, session_id)
    assert len(known) == 2 and known.last("responses", "a") is None and known.last("responses", "c") is not None


def test_a_list_resending_only_the_start_of_the_main_one_is_kept_beside_it():
    """A side call that resends the main conversation's developer prompt and asks something else shares its
    start, and is shorter: kept beside the main list, which the main's next turn goes on from."""
    known = KnownInputs()
    folded(known, FIRST)
    side = [*FIRST[:1], {"role": "user", "content": "Write a title for this task."}]
    to_check, result = folded(known, side)
    assert to_check == (1,) and result == whole(side)
    fresh = known.fresh_items
    to_check, second = folded(known, SECOND)
    assert to_check == tuple(range(len(FIRST), len(SECOND))) and second == whole(SECOND)
    assert known.fresh_items - fresh == len(SECOND) - len(FIRST) and len(known) == 2


def test_a_session_keeps_its_last_lists_and_forgets_them_all_at_its_finish():
    known = KnownInputs()
    for name in ("first", "second", "third"):
        folded(known, [{"role": "developer", "content": f"You are the {name} agent."}, *FIRST[1:]])
    folded(known, FIRST, session_id="other")
    assert len(known) == 4 and len(known.lists("responses", "s")) == 3
    known.forget("s")
    assert len(known) == 1 and known.lists("responses", "s") == ()


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


def messages_folded(known: KnownInputs, items: list[Any], system: Any = CLAUDE_SYSTEM):
    intake = ListIntake(known, api="messages", key="messages")
    to_check = intake.look_up(items, session_id="s")
    fold, message_keys = intake.fold(items, lambda: Conversation.starting(system), context=json.dumps(system).encode())
    return to_check, fold, message_keys


def test_messages_whose_cache_marks_moved_are_folded_from_the_first_changed_one():
    known = KnownInputs()
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
    known = KnownInputs()
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
    known = KnownInputs()
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
    assert proxy.app[keys.KNOWN_INPUTS].resent == 1
    before = await store_snapshot(proxy.app[keys.STORE])
    bad = [*echoed, *body["output"], {"type": "image", "url": "x"}]
    status, refused = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": bad, "store": False}, token=session.api_key
    )
    assert status == 400 and refused["error"]["param"] == f"input[{len(bad) - 1}].type", refused
    too_long = [*echoed, *body["output"], {"role": "user", "content": "x" * (4 * 1024 * 1024 + 1)}]
    status, refused = await proxy.request(
        "POST", "/v1/responses", json={"model": "m", "input": too_long, "store": False}, token=session.api_key
    )
    assert status == 400 and refused["error"]["param"] == f"input[{len(too_long) - 1}].content", refused
    assert await store_snapshot(proxy.app[keys.STORE]) == before
