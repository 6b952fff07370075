"""A TurnRunner over a memory store and a fleet of one fake engine, with a clock the tests move."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from devtools.fake_engine import FakeEngine
from rollout_proxy.core.rendering import Renderers, RenderingConfig
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turns import TurnRunner
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.metrics import Metrics
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.tokenization.parsers import OutputParser


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@dataclass
class Turns:
    fake: FakeEngine
    engine: VLLMEngine
    store: MemoryStore
    clock: Clock
    metrics: Metrics
    runner: TurnRunner
    tree: ResponseTree


@pytest.fixture
async def turns(fake_engine: FakeEngine) -> AsyncIterator[Turns]:
    clock = Clock()
    store = MemoryStore(clock=clock)
    engine = VLLMEngine(fake_engine.url)
    metrics = Metrics()
    fleet = Fleet([engine], metrics=metrics)
    await fleet.start()
    runner = TurnRunner(
        store=store,
        engines=fleet,
        parser=OutputParser.named("hermes", "think"),
        metrics=metrics,
        renderers=Renderers(RenderingConfig(), metrics=metrics),
    )
    yield Turns(
        fake=fake_engine,
        engine=engine,
        store=store,
        clock=clock,
        metrics=metrics,
        runner=runner,
        tree=ResponseTree(store=store, metrics=metrics),
    )
    await fleet.close()
