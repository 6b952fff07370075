"""``serve``'s process settings: the cyclic garbage collector tuned for serving (``tune_gc``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import orjson
import pytest

from rollout_proxy.proxy.server import tune_gc

# a turn's parsed body: a dict per message, all alive while the turn runs
BODY = orjson.dumps({"messages": [{"role": "user", "content": f"turn {k}"} for k in range(400)]})


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def collections_while_holding(bodies: int) -> int:
    """Youngest-generation collections while ``bodies`` parsed turn bodies are held at once."""
    counted: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            counted.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        held = [orjson.loads(BODY) for _ in range(bodies)]
    finally:
        gc.callbacks.remove(count)
    assert len(held) == bodies
    return len(counted)


def test_turns_in_flight_no_longer_set_off_a_collection_every_few_turns(restored_gc):
    gc.set_threshold(700, 10, 10)  # Python's default
    assert collections_while_holding(32) >= 10
    tune_gc(50_000)
    assert gc.get_threshold() == (50_000, 10, 10)
    assert gc.get_freeze_count() > 0  # what start-up built is never walked again
    assert collections_while_holding(32) == 0


def test_cyclic_garbage_is_still_collected(restored_gc):
    tune_gc(1_000)
    gc.collect()

    class Node:
        pass

    collected: list[int] = []
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    try:
        for _ in range(5_000):  # cycles only a collection frees
            a, b = Node(), Node()
            a.other, b.other = b, a
    finally:
        gc.callbacks.pop()
    assert sum(collected) > 0


def test_zero_leaves_pythons_collector_alone(restored_gc):
    gc.set_threshold(700, 10, 10)
    frozen = gc.get_freeze_count()
    tune_gc(0)
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == frozen
