"""A shared request bound (a job's request_concurrency) kept by the store: never more holders
than the limit, waiters get a slot as one is given back, and on Redis a holder that died (never
gave its slot back) frees it when its lease runs out."""

from __future__ import annotations

import asyncio

from rollout_proxy.state import keys
from rollout_proxy.state.redis import RedisStore


async def test_no_more_than_the_limit_hold_a_slot_at_once(store) -> None:
    holding = most = 0

    async def request() -> None:
        nonlocal holding, most
        async with store.request_slot("job-1", 3, lease=30.0):
            holding += 1
            most = max(most, holding)
            await asyncio.sleep(0.05)
            holding -= 1

    await asyncio.gather(*(request() for _ in range(12)))
    assert most == 3


async def test_bounds_with_other_keys_are_apart(store) -> None:
    async with store.request_slot("job-a", 1, lease=30.0):
        async with asyncio.timeout(5):
            async with store.request_slot("job-b", 1, lease=30.0):
                pass


async def test_a_slot_whose_holder_died_is_free_once_its_lease_runs_out(redis_url: str) -> None:
    store = await RedisStore.connect(redis_url)
    try:
        leases = keys.request_leases_key("job-dead")
        await store._redis.delete(leases)
        assert await store._try_slot(leases, "a-worker-that-died", 1, 0.3)  # taken, never given back
        assert not await store._try_slot(leases, "another", 1, 30.0)
        async with asyncio.timeout(10):  # generous: the lease is 0.3 s
            async with store.request_slot("job-dead", 1, lease=30.0):
                assert await store._redis.zcard(leases) == 1
        assert await store._redis.zcard(leases) == 0  # given back
    finally:
        await store.close()


async def test_a_held_slot_outlives_its_lease_while_its_holder_lives(redis_url: str) -> None:
    """The lease is renewed while the slot is held: only a holder that died loses it to expiry."""
    store = await RedisStore.connect(redis_url)
    try:
        leases = keys.request_leases_key("job-live")
        await store._redis.delete(leases)
        async with store.request_slot("job-live", 1, lease=2.0):
            await asyncio.sleep(4.5)  # over twice the lease
            assert not await store._try_slot(leases, "another", 1, 30.0)
        assert await store._try_slot(leases, "another", 1, 30.0)
    finally:
        await store.close()


async def test_the_memory_store_keeps_a_bound_only_while_it_is_used() -> None:
    """A bound per key lives while a slot of it is held or waited for: keys of jobs long done (or one key per
    session) hold nothing. Its limit is the one it was made with while it lives."""
    from rollout_proxy.state.memory import MemoryStore

    store = MemoryStore()
    for index in range(100):
        async with store.request_slot(f"session-{index}", 1, lease=30.0):
            assert len(store._limits) == 1
    assert store._limits == {}

    entered = asyncio.Event()

    async def holder() -> None:
        async with store.request_slot("job", 1, lease=30.0):
            entered.set()
            await asyncio.sleep(0.1)

    async def waiter() -> None:
        await entered.wait()
        async with store.request_slot("job", 1, lease=30.0):
            assert len(store._limits) == 1

    await asyncio.gather(holder(), waiter())
    assert store._limits == {}

    with_error = store.request_slot("job", 1, lease=30.0)
    try:
        async with with_error:
            raise RuntimeError("the turn failed")
    except RuntimeError:
        pass
    assert store._limits == {}  # given back however the turn ended
