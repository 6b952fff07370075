"""EnginePool over two fake engines: least-loaded for new sessions, sticky after, bounded per engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.pool import EnginePool
from rollout_proxy.engines.vllm_http import VLLMEngine

PARAMS = SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=0)


@pytest.fixture
async def pool(two_fakes):
    engines = EnginePool([VLLMEngine(fake.url) for fake in two_fakes], max_inflight=2)
    yield engines
    await engines.close()


def test_a_pool_needs_an_engine():
    with pytest.raises(ValueError):
        EnginePool([])


async def test_a_new_session_gets_the_least_loaded_engine(pool):
    first, second = pool.engines
    async with pool.slot(first):
        assert pool.pick() is second
        async with pool.slot(second), pool.slot(first):
            assert pool.pick() is second  # 2 in flight on the first, 1 on the second
    async with pool.slot(second):
        assert pool.pick() is first


async def test_a_failed_call_gives_its_slot_back(pool):
    first, second = pool.engines
    with pytest.raises(RuntimeError):
        async with pool.slot(first):
            raise RuntimeError("the call failed")
    async with pool.slot(second):
        assert pool.pick() is first


async def test_a_session_stays_on_its_engine(pool, two_fakes):
    first, second = pool.engines
    async with pool.slot(first), pool.slot(first):
        assert pool.get(first.url) is first  # busier, still sticky
    assert pool.get(None) in (first, second)
    prompt = np.asarray([1, 2, 3], dtype=np.int32)
    await pool.get(second.url).complete(prompt, PARAMS)
    assert two_fakes[0].completions == [] and two_fakes[1].prompts == [[1, 2, 3]]


async def test_a_session_whose_engine_left_moves_to_another(two_fakes):
    gone, staying = (VLLMEngine(fake.url) for fake in two_fakes)
    pool = EnginePool([staying])
    try:
        moved = pool.get(gone.url)
        assert moved is staying
        await moved.complete(np.asarray([5, 6, 7], dtype=np.int32), PARAMS)
        assert two_fakes[1].prompts == [[5, 6, 7]] and two_fakes[0].completions == []
    finally:
        await pool.close()
        await gone.close()


async def test_calls_in_flight_are_bounded_per_engine(pool, two_fakes):
    for fake in two_fakes:
        fake.delay = 0.2

    async def call(engine):
        async with pool.slot(engine):
            await engine.complete(np.asarray([1, 2, 3], dtype=np.int32), PARAMS)

    first, second = pool.engines
    await asyncio.gather(*(call(engine) for engine in (first, second) * 4))
    for fake in two_fakes:
        assert len(fake.completions) == 4
        assert fake.max_inflight == 2  # the bound (2), on each engine, not across the pool


async def test_close_closes_every_engine_client(two_fakes):
    engines = [VLLMEngine(fake.url) for fake in two_fakes]
    pool = EnginePool(engines)
    for engine in engines:
        await engine.info()
    clients = [engine._session for engine in engines]  # the clients the engines opened
    await pool.close()
    assert all(client is not None and client.closed for client in clients)
