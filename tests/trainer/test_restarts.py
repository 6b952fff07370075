"""A trainer that dies mid-step loses no group: the feed keeps what it did not acknowledge.

The trainer runs as its own process (``python -m rollout_proxy.trainer``) and is killed with SIGKILL
while it is inside a step: its groups read, trained on, the new weights written, the fleet's pause
sent (the admin API here holds the pause, so the moment is certain). A trainer started again under
the same consumer name gets them back (its pending entries); one under another name claims them once
they sat idle ``--claim-idle-ms`` (XAUTOCLAIM). Either trains on the whole step, once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from redis import asyncio as aioredis

from rollout_proxy.embedded import serve_app
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.state.feed import open_feed
from rollout_proxy.state.keys import feed_stream_key
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import FleetDriver
from rollout_proxy.trainer.grpo import GRPOConfig, GRPOLearner
from rollout_proxy.trainer.loop import STATE, ReferenceTrainer, TrainerState
from tests.harness import ADMIN_KEY
from tests.trainer.conftest import short_answer_job

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class AdminStub:
    """The proxy's fleet API, as a trainer uses it, with a pause that can be held."""

    version: int = 0
    hold: asyncio.Event = field(default_factory=asyncio.Event)  # set: pauses answer
    pauses: int = 0
    paused: asyncio.Event = field(default_factory=asyncio.Event)  # a pause arrived
    resumes: list[int] = field(default_factory=list)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/admin/engines", self._engines)
        app.router.add_post("/v1/admin/pause", self._pause)
        app.router.add_post("/v1/admin/resume", self._resume)
        return app

    def _fleet(self) -> dict[str, Any]:
        return {"policy_version": self.version, "paused": False, "failed": 0, "engines": []}

    async def _engines(self, request: web.Request) -> web.Response:
        return web.json_response(self._fleet())

    async def _pause(self, request: web.Request) -> web.Response:
        self.pauses += 1
        self.paused.set()
        await self.hold.wait()
        return web.json_response(self._fleet())

    async def _resume(self, request: web.Request) -> web.Response:
        self.version = int((await request.json())["policy_version"])
        self.resumes.append(self.version)
        return web.json_response(self._fleet())


@pytest.fixture
async def admin_stub() -> AsyncIterator[AdminStub]:
    stub = AdminStub()
    runner, stub.url = await serve_app(stub.app())
    try:
        yield stub
    finally:
        stub.hold.set()
        await runner.cleanup()


async def publish_one_step(tiny_fleet, redis_url: str, stream: str, samples: int) -> list[str]:
    """One step of the short-answer job on the feed (no trainer behind it); its group ids."""
    job = short_answer_job(samples=samples, generations=2, steps=1, training_loop={})
    feed = await open_feed(redis_url, stream=stream)
    try:
        await JobRunner(job, proxy_url=tiny_fleet.proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
        return [entry.group.group_id for entry in await feed.read(limit=100)]
    finally:
        await feed.close()


async def start_trainer(
    stub: AdminStub, redis_url: str, stream: str, checkpoint: Path, out: Path, *extra: str
) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollout_proxy.trainer",
        "--proxy",
        stub.url,
        "--admin-key",
        ADMIN_KEY,
        "--feed",
        redis_url,
        "--stream",
        stream,
        "--model",
        str(checkpoint),
        "--out",
        str(out),
        "--steps",
        "1",
        "--micro-batch-tokens",
        "1",
        *extra,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def pending(redis_url: str, stream: str) -> dict[str, int]:
    """Unacknowledged entries of the trainers' group, per consumer."""
    client = aioredis.from_url(redis_url)
    try:
        summary = await client.xpending(feed_stream_key(stream), "trainer")
    finally:
        await client.aclose()
    return {consumer["name"].decode(): int(consumer["pending"]) for consumer in summary["consumers"]}


@pytest.mark.parametrize("second", ["trainer-0", "trainer-1"], ids=["same-consumer", "another-consumer"])
async def test_a_trainer_killed_mid_step_loses_no_group(
    tiny_fleet, redis_url, tiny_checkpoint, tmp_path, admin_stub, second
):
    stream = f"killed-{second}-{os.getpid()}-{id(tmp_path)}"
    group_ids = await publish_one_step(tiny_fleet, redis_url, stream, samples=3)
    out = tmp_path / "trainer"

    first = await start_trainer(admin_stub, redis_url, stream, tiny_checkpoint, out, "--consumer", "trainer-0")
    try:
        async with asyncio.timeout(180):
            await admin_stub.paused.wait()  # inside its step: trained, weights written, pausing the fleet
        assert (out / "weights" / "v000001" / "model.safetensors").is_file()
        assert await pending(redis_url, stream) == {"trainer-0": 3}  # read, not acknowledged
    finally:
        first.send_signal(signal.SIGKILL)
        await first.wait()
    assert not (out / "steps.jsonl").exists() and not (out / STATE).exists()

    admin_stub.hold.set()  # the fleet answers again
    again = await start_trainer(
        admin_stub, redis_url, stream, tiny_checkpoint, out, "--consumer", second, "--claim-idle-ms", "200"
    )
    async with asyncio.timeout(180):
        _, stderr = await again.communicate()
    assert again.returncode == 0, stderr.decode()[-3000:]
    [record] = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert record["step"] == 0 and sorted(record["group_ids"]) == sorted(group_ids)  # the whole step, once
    assert record["mismatch"]["current"]["max_abs"] == 0.0
    assert admin_stub.resumes == [1] and admin_stub.pauses == 2
    assert sum((await pending(redis_url, stream)).values()) == 0  # every group acknowledged
    assert TrainerState.load(out / STATE) == TrainerState(1, record["weights"], 0, record["group_ids"])


class AckFails(TrajectoryConsumer):
    """A consumer whose process dies at its first acknowledgement (after the update, before the ack)."""

    async def ack(self, entry: Any) -> None:
        raise ConnectionError("the trainer died before acknowledging")


async def test_a_trainer_restarted_after_its_update_does_not_train_twice(
    tiny_fleet, redis_url, tiny_checkpoint, tmp_path, admin_stub
):
    """The update went out (state.json says so) but the acknowledgement did not: the restarted trainer
    gets the step's groups again, acknowledges them, and does not train on them again."""
    admin_stub.hold.set()
    stream = f"restart-{os.getpid()}-{id(tmp_path)}"
    group_ids = await publish_one_step(tiny_fleet, redis_url, stream, samples=2)
    learner = GRPOLearner(tiny_checkpoint, GRPOConfig(learning_rate=1e-2, micro_batch_tokens=1))
    async with ProxyClient(admin_stub.url, ADMIN_KEY) as admin:
        driver = FleetDriver(admin)
        async with AckFails(redis_url, stream=stream, block_ms=100) as feed:
            crashing = ReferenceTrainer(learner, feed, driver, tmp_path, version=0, log=lambda _: None)
            with pytest.raises(ConnectionError):
                await crashing.run(1)
        assert await pending(redis_url, stream) == {"trainer-0": 2}
        state = TrainerState.load(tmp_path / STATE)
        assert state is not None and state.version == 1 and sorted(state.group_ids) == sorted(group_ids)

        said: list[str] = []
        async with TrajectoryConsumer(redis_url, stream=stream, block_ms=100, stop_when_idle=True) as feed:
            restarted = ReferenceTrainer(learner, feed, driver, tmp_path, version=1, state=state, log=said.append)
            assert await restarted.run() == []  # nothing trained
    assert sum((await pending(redis_url, stream)).values()) == 0
    assert admin_stub.resumes == [1]  # one update in all
    assert sum("trained on before the restart" in line for line in said) == 2
