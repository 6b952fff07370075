"""The Redis store's held paths: a worker keeps, per session, the path it last read or wrote, so a turn
reads only what is new below it. Bounded by sessions and bytes, dropped when its session finishes
here, when it expires, and when left unused a minute (finished elsewhere, or waiting long)."""

from __future__ import annotations

import numpy as np

from rollout_proxy.bounded import ENTRY_OVERHEAD
from rollout_proxy.records import NodeKind, ResponseNode
from rollout_proxy.state.redis import HeldPaths, _footprint


def node(index: int, parent: str | None, tokens: int = 100, text: str = "x" * 200) -> ResponseNode:
    return ResponseNode(
        id=f"n{index}",
        parent_id=parent,
        kind=NodeKind.GENERATED,
        api="chat",
        messages=[{"role": "user", "content": text}, {"role": "assistant", "content": text}],
        n_input_messages=1,
        prompt_ids=np.arange(tokens, dtype=np.int32),
        output_ids=np.arange(tokens, dtype=np.int32),
        output_logprobs=np.zeros(tokens, dtype=np.float32),
    )


def test_held_paths_count_their_arrays_and_text_and_stay_within_their_bytes():
    one = _footprint([node(0, None)])
    assert one >= 2 * 2 * 100 * 4 + 100 * 4 + 2 * 200  # ids twice (the leaf's path ids), logprobs, text
    paths = HeldPaths(max_bytes=10 * (one + ENTRY_OVERHEAD))
    for session in range(50):
        paths.hold(f"s{session}", [node(0, None)])
    assert len(paths) == 10 and paths.bytes == 10 * (one + ENTRY_OVERHEAD)
    assert paths.get("s49") is not None and paths.get("s0") is None  # the least recently used went


def test_a_held_path_goes_when_its_session_finishes_or_it_is_left_unused():
    now = [1000.0]
    paths = HeldPaths(idle=60.0, clock=lambda: now[0])
    paths.hold("busy", [node(0, None)])
    paths.hold("idle", [node(0, None)])
    paths.hold("done", [node(0, None)])
    paths.drop("done")
    assert len(paths) == 2
    for _ in range(3):
        now[0] += 30
        paths.extend("busy", [node(len(paths.get("busy") or []), (paths.get("busy") or [])[-1].id)])
        paths.expire()
    assert paths.get("idle") is None and len(paths.get("busy") or []) == 4
    grown = paths.bytes
    now[0] += 61
    assert paths.expire() == 1 and len(paths) == 0 and paths.bytes == 0 and grown > 0


def test_a_held_path_goes_when_its_session_expires():
    now = [1000.0]
    paths = HeldPaths(idle=60.0, clock=lambda: now[0])
    paths.hold("short", [node(0, None)])
    paths.expires("short", 1010.0)  # as the session read found it
    paths.hold("short", [node(1, None)])  # a new root keeps the session's expiry
    paths.hold("unknown", [node(0, None)])
    now[0] = 1010.0
    assert paths.expire() == 1 and paths.get("short") is None and paths.get("unknown") is not None
