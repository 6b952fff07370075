"""A resent Responses input is checked, folded and keyed only past what the session sent last
(``proxy.known_input``); the result, or the refusal, is a whole check's."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rollout_proxy.proxy import keys
from rollout_proxy.proxy.known_input import InputIntake, KnownInputs
from rollout_proxy.tokenization.messages import canonical_key
from rollout_proxy.wire.responses import input_to_messages
from tests.harness import ProxyHarness, store_snapshot

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harnesses" / "codex-0.171.0"


def codex_turn(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(json.loads((FIXTURES / name).read_text())["body"]["input"])


FIRST = codex_turn("responses-turn1.json")
SECOND = codex_turn("responses-turn2-after-tool-call.json")  # FIRST, then reasoning, a call, its output


def folded(known: KnownInputs, items: list[Any], session_id: str = "s") -> tuple[tuple[int, ...] | None, Any]:
    intake = InputIntake(known)
    to_check = intake.look_up(items, session_id=session_id)
    return to_check, intake.messages(items)


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
    remembered = known.last("s")
    assert remembered is not None
    _, after = folded(known, [*start, call, output])
    assert after == whole([*start, call, output])
    assert before == whole(start)  # what the first turn answered is not changed by the second
    assert "tool_calls" not in remembered.fold.messages[-1]  # nor what was remembered of it
    _, again = folded(known, [*start, call, output])  # the same input once more: everything reused
    assert again == whole([*start, call, output])


@pytest.mark.parametrize(
    "change",
    [
        lambda items: items[0]["content"][0].update(text="A rewritten developer prompt."),  # history rewritten
        lambda items: items.pop(2),  # an item dropped
        lambda items: items[1].update(id="msg_other"),  # the same message, other bytes
    ],
)
def test_an_input_that_does_not_resend_the_last_one_is_checked_whole(change):
    known = KnownInputs()
    folded(known, FIRST)
    items = codex_turn("responses-turn2-after-tool-call.json")
    change(items)
    to_check, result = folded(known, items)
    assert to_check == tuple(range(len(items))) and known.resent == 0
    assert result == whole(items)


def test_sessions_are_bounded():
    known = KnownInputs(max_sessions=2)
    for session_id in ("a", "b", "c"):
        folded(known, FIRST, session_id)
    assert len(known) == 2 and known.last("a") is None and known.last("c") is not None


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
