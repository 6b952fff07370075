"""Weights onto the fleet: pause through the proxy, reload every paused engine, resume at the next version."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import EngineError
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.trainer.fleet import FleetDriver, FleetUpdateFailed
from tests.harness import ADMIN_KEY, ProxyHarness


class Weights:
    """A FakeModel that only records reloads (and can refuse them)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loaded: list[str] = []

    def score(self, prompt, tokens):
        return [-1.0] * len(tokens)

    def reload(self, weights_path: str) -> None:
        if self.fail:
            raise OSError(f"no checkpoint at {weights_path}")
        self.loaded.append(weights_path)


@dataclass
class TwoEngines:
    weights: list[Weights]
    engines: list[FakeEngine]
    urls: list[str]
    proxy: ProxyHarness
    admin: ProxyClient


@asynccontextmanager
async def two_engines(tokenizer_dir: Path) -> AsyncIterator[TwoEngines]:
    """A proxy over two fake engines that record their reloads, and its admin client."""
    weights = [Weights(), Weights()]
    engines = [FakeEngine(tokenizer_dir, model=w) for w in weights]
    async with (
        FakeEngineServer(engines[0]) as first,
        FakeEngineServer(engines[1]) as second,
        ProxyHarness.running(engine_urls=[first, second]) as proxy,
        ProxyClient(proxy.url, ADMIN_KEY) as admin,
    ):
        yield TwoEngines(weights, engines, [first, second], proxy, admin)


async def test_every_paused_engine_reloads_then_the_fleet_resumes_one_version_on(tokenizer_dir):
    async with two_engines(tokenizer_dir) as fleet:
        weights, engines = fleet.weights, fleet.engines
        driver = FleetDriver(fleet.admin)
        assert await driver.version() == 0
        update = await driver.update(Path("/ckpt/v000001"))
        assert (update.previous, update.version) == (0, 1) and sorted(update.reloaded) == sorted(fleet.urls)
        assert [w.loaded for w in weights] == [["/ckpt/v000001"], ["/ckpt/v000001"]]
        assert [e.weight_version for e in engines] == ["1", "1"] and not any(e.paused for e in engines)
        assert [e.pauses for e in engines] == [["keep"], ["keep"]]
        assert await driver.version() == 1

        weights[1].fail = True  # one engine cannot load the next checkpoint: nobody resumes at version 2
        with pytest.raises(FleetUpdateFailed, match=r"failed on 1 of 2 engine\(s\).*left paused"):
            await driver.update(Path("/ckpt/v000002"))
        listing = (await fleet.proxy.request("GET", "/v1/admin/engines", token=ADMIN_KEY))[1]
        assert listing["paused"] and listing["policy_version"] == 1
        assert [e.weight_version for e in engines] == ["1", "1"]


async def test_a_fleet_left_paused_gets_the_weights_on_every_engine(tokenizer_dir):
    """A trainer killed inside its update leaves the fleet paused; the next update (its restart's) pauses again,
    which pauses nothing new, and must still reload every engine the resume will resume at the new version."""
    async with two_engines(tokenizer_dir) as fleet:
        left = await fleet.admin.apost("/v1/admin/pause", {"mode": "keep"}, what="the killed trainer's pause")
        assert left["paused"] and all(engine["state"] == "paused" for engine in left["engines"])
        update = await FleetDriver(fleet.admin).update(Path("/ckpt/v000001"))
        assert (update.previous, update.version) == (0, 1) and sorted(update.reloaded) == sorted(fleet.urls)
        assert [w.loaded for w in fleet.weights] == [["/ckpt/v000001"], ["/ckpt/v000001"]]
        assert [e.weight_version for e in fleet.engines] == ["1", "1"] and not any(e.paused for e in fleet.engines)


async def test_the_engine_client_sends_vllms_reload_call(tokenizer_dir):
    weights = Weights()
    engine = FakeEngine(tokenizer_dir, model=weights)
    async with FakeEngineServer(engine) as url:
        client = VLLMEngine(url)
        try:
            await client.reload_weights("/ckpt/v7", within=30.0)
            assert engine.rpcs == [
                {"method": "reload_weights", "args": [], "kwargs": {"weights_path": "/ckpt/v7"}, "timeout": 30.0}
            ]
            assert weights.loaded == ["/ckpt/v7"] and engine.reloads == 1
            weights.fail = True
            with pytest.raises(EngineError, match="collective_rpc with 500"):
                await client.reload_weights("/ckpt/v8", within=30.0)
        finally:
            await client.close()
    engine.dev_mode = False  # no dev mode: vLLM serves no /collective_rpc
    async with FakeEngineServer(engine) as url:
        client = VLLMEngine(url)
        try:
            with pytest.raises(EngineError, match="404"):
                await client.reload_weights("/ckpt/v9", within=5.0)
        finally:
            await client.close()
