"""The memory store gives memory back on a timer: no traffic needed, no scan of live sessions."""

from __future__ import annotations

import asyncio

from rollout_proxy.state.memory import MemoryStore
from tests.state.test_store_contract import node, put, session_record

TICK = 0.01


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class CountingDict(dict):
    """A dict that counts how sessions are reached: lookups, and whole scans."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookups = 0
        self.scans = 0

    def get(self, *args):
        self.lookups += 1
        return super().get(*args)

    def __getitem__(self, key):
        self.lookups += 1
        return super().__getitem__(key)

    def __iter__(self):
        self.scans += 1
        return super().__iter__()

    def items(self):
        self.scans += 1
        return super().items()

    def values(self):
        self.scans += 1
        return super().values()


def record_at(clock: Clock, ttl: float):
    record = session_record()
    record.created_at, record.expires_at = clock.now, clock.now + ttl
    return record


async def test_sessions_expire_without_any_traffic():
    clock = Clock()
    store = MemoryStore(clock=clock, sweep_every=TICK)
    short, long = record_at(clock, 30), record_at(clock, 300)
    for record in (short, long):
        await store.create_session(record)
        await put(store, record.id, node(record.id, None))
    clock.now += 31
    await asyncio.sleep(TICK * 5)  # the timer ticks; nothing calls the store
    assert list(store._sessions) == [long.id]
    clock.now += 300
    await asyncio.sleep(TICK * 5)
    assert store._sessions == {} and store._expiries == []
    await store.close()


async def test_a_sweep_looks_only_at_the_sessions_that_expire():
    clock = Clock()
    store = MemoryStore(clock=clock, sweep_every=3600)  # sweeps by hand here
    for _ in range(1_000):
        await store.create_session(record_at(clock, 300))
    for _ in range(10):
        await store.create_session(record_at(clock, 30))
    store._sessions = counted = CountingDict(store._sessions)
    clock.now += 60
    assert store.expire() == 10
    assert counted.scans == 0 and counted.lookups == 10
    assert len(store._sessions) == len(store._expiries) == 1_000
    counted.lookups = 0
    assert store.expire() == 0 and counted.lookups == 0  # nothing due: the heap's head says so
    await store.close()


async def test_an_expired_session_touched_first_is_not_dropped_twice():
    clock = Clock()
    store = MemoryStore(clock=clock, sweep_every=3600)
    record = record_at(clock, 30)
    await store.create_session(record)
    clock.now += 31
    assert await store.get_session(record.id) is None  # dropped on touch
    assert store.expire() == 0 and store._expiries == []
    await store.close()


async def test_close_stops_the_timer():
    store = MemoryStore(sweep_every=TICK)
    await store.create_session(session_record())
    sweeper = store._sweeper
    assert sweeper is not None and not sweeper.done()
    await store.close()
    assert sweeper.done() and store._sweeper is None
