"""A session keeps a few conversations (``proxy.session_conversations``): one that goes on takes its own
place, a new one joins the others, the least recently used go first, and the bounds in sessions and bytes
hold as for one list per session."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_proxy.bounded import ENTRY_OVERHEAD
from rollout_proxy.proxy.session_conversations import SessionConversations


@dataclass(frozen=True)
class Listed:
    name: str
    size: int = 100


def names(kept: tuple[Listed, ...]) -> list[str]:
    return [each.name for each in kept]


def test_a_conversation_that_goes_on_takes_its_place_and_a_new_one_joins_the_others():
    memory: SessionConversations[str, Listed] = SessionConversations(max_sessions=10, max_bytes=10_000)
    main = Listed("main")
    memory.keep("s", main)
    subagent = Listed("subagent")
    memory.keep("s", subagent)  # resends nothing kept: beside the main
    longer = Listed("main, a turn on")
    memory.keep("s", longer, resent=main, replace=True)
    assert names(memory.of("s")) == ["main, a turn on", "subagent"]
    side = Listed("side call")  # resends the start of the main's list only: kept beside it, the main used now
    memory.keep("s", side, resent=longer)
    assert names(memory.of("s")) == ["side call", "main, a turn on", "subagent"]
    assert memory.count() == 3 and len(memory) == 1 and memory.bytes == 300 + ENTRY_OVERHEAD
    assert memory.of("other") == ()


def test_past_its_share_a_session_drops_the_lists_it_used_least_recently():
    memory: SessionConversations[str, Listed] = SessionConversations(max_sessions=10, max_bytes=10_000, per_session=4)
    main = Listed("main 0")
    memory.keep("s", main)
    for turn in range(1, 6):  # a side call between each two main turns, each of them new
        memory.keep("s", Listed(f"side {turn}"))
        following = Listed(f"main {turn}")
        memory.keep("s", following, resent=main, replace=True)
        main = following
    assert names(memory.of("s")) == ["main 5", "side 5", "side 4", "side 3"]


def test_the_bounds_in_sessions_and_bytes_hold():
    memory: SessionConversations[str, Listed] = SessionConversations(max_sessions=2, max_bytes=10_000)
    for session in ("a", "b", "c"):
        memory.keep(session, Listed(session))
    assert len(memory) == 2 and memory.of("a") == () and names(memory.of("c")) == ["c"]
    memory = SessionConversations(max_sessions=2, max_bytes=1_000)
    memory.keep("s", Listed("first"))
    memory.keep("s", Listed("second", size=500))
    memory.keep("s", Listed("third", size=200))  # with the other two: past the bytes; the oldest goes
    assert names(memory.of("s")) == ["third", "second"] and memory.bytes == 700 + ENTRY_OVERHEAD
    memory.keep("s", Listed("huge", size=5_000))  # too large alone: left out, the others stay
    assert names(memory.of("s")) == ["third", "second"]


def test_a_finish_forgets_all_of_a_sessions_lists_and_the_expiry_drops_them():
    memory: SessionConversations[str, Listed] = SessionConversations(max_sessions=10, max_bytes=10_000)
    for name in ("main", "subagent", "side"):
        memory.keep("done", Listed(name), until=50.0)
        memory.keep("open", Listed(name), until=100.0)
    memory.forget("done")
    assert memory.of("done") == () and memory.count() == 3
    assert memory.expire(99.0) == 0 and memory.count() == 3
    assert memory.expire(100.0) == 1 and memory.count() == 0 and memory.bytes == 0
