"""A trainer killed anywhere trains each group once, puts each update on the fleet once, and goes on with
AdamW where it was.

The trainer runs as its own process (``python -m rollout_proxy.trainer``) and is killed with SIGKILL in each
window of its step, held open from the outside: the proxy's admin API (a stub here) holds its pause (the step
trained, its checkpoint and intent written, the fleet not yet moved) or its resume's answer (the fleet at the
new version, nothing recorded), or Redis is stopped once the fleet resumed (the step recorded, its
acknowledgement blocked). A trainer started again finishes the step from what is on disk and in Redis and
trains the next one: the run equals one that was never killed, weights and AdamW's moments bit for bit. The
windows no outside part can hold (inside the save, between the step's line and state.json, inside the line)
are crashes raised in-process, restarted from the disk by a new learner and trainer.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
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
from rollout_proxy.trainer.loop import (
    STATE,
    STEP_LOG,
    ReferenceTrainer,
    ResumeConflict,
    ResumePoint,
    StepIntent,
    TrainerState,
    weights_dir,
)
from rollout_proxy.wire.feed import FeedGroup
from tests.conftest import free_port
from tests.harness import ADMIN_KEY
from tests.trainer.conftest import short_answer_job

torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402

from rollout_proxy.trainer.batch import rollouts_of  # noqa: E402
from rollout_proxy.trainer.grpo import OPTIMIZER, GRPOConfig, GRPOLearner  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: the CLI's options in these tests, and the learner config they make (a step large enough to move AdamW)
LEARNING = ("--lr", "1e-2", "--micro-batch-tokens", "1")
CONFIG = GRPOConfig(learning_rate=1e-2, micro_batch_tokens=1)


@dataclass
class AdminStub:
    """The proxy's fleet API, as a trainer uses it, with a pause and a resume's answer that can be held."""

    version: int = 0
    hold: asyncio.Event = field(default_factory=asyncio.Event)  # set: pauses answer
    pauses: int = 0
    paused: asyncio.Event = field(default_factory=asyncio.Event)  # a pause arrived
    resumes: list[int] = field(default_factory=list)
    hold_resume: asyncio.Event = field(default_factory=asyncio.Event)  # set: resumes answer (once applied)
    resumed: asyncio.Event = field(default_factory=asyncio.Event)  # a resume was applied
    on_resume: Callable[[], None] | None = None  # called once a resume is applied, before it answers
    url: str = ""

    def __post_init__(self) -> None:
        self.hold_resume.set()

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
        self.resumed.set()
        if self.on_resume is not None:
            self.on_resume()
        await self.hold_resume.wait()
        return web.json_response(self._fleet())

    def answer_everything(self) -> None:
        self.hold.set()
        self.hold_resume.set()
        self.on_resume = None


@pytest.fixture
async def admin_stub() -> AsyncIterator[AdminStub]:
    stub = AdminStub()
    runner, stub.url = await serve_app(stub.app())
    try:
        yield stub
    finally:
        stub.answer_everything()
        await runner.cleanup()


@dataclass
class StoppableRedis:
    """A redis-server of this test alone, which the test can freeze (SIGSTOP) and thaw."""

    process: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.process.send_signal(signal.SIGCONT)


@pytest.fixture
def stoppable_redis() -> Iterator[StoppableRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed; run scripts/test.sh or apt-get install redis-server")
    port, workdir = free_port(), tempfile.mkdtemp(prefix="rp-redis-stoppable-")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    redis = StoppableRedis(process, f"redis://127.0.0.1:{port}/0")
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)
        yield redis
    finally:
        redis.cont()
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


async def publish_steps(
    tiny_fleet, redis_url: str, stream: str, *, samples: int, steps: int = 1, policy: str = "base"
) -> list[FeedGroup]:
    """``steps`` steps of the short-answer job on the feed (no trainer behind it: the runner does not wait),
    its sessions on ``policy`` (a LoRA policy must have a version)."""
    job = short_answer_job(samples=samples, generations=2, steps=steps, training_loop={})
    job.proxy.policy = policy
    feed = await open_feed(redis_url, stream=stream)
    try:
        await JobRunner(job, proxy_url=tiny_fleet.proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
        return [entry.group for entry in await feed.read(limit=100)]
    finally:
        await feed.close()


async def start_trainer(
    stub: AdminStub, redis_url: str, stream: str, checkpoint: Path, out: Path, log: Path, *extra: str
) -> asyncio.subprocess.Process:
    """The trainer as its own process, its stderr (what it says) to ``log``."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    with log.open("wb") as said:
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
            *LEARNING,
            *extra,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=said,
        )


async def kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGKILL)
    await process.wait()


async def pending(redis_url: str, stream: str) -> dict[str, int]:
    """Unacknowledged entries of the trainers' group, per consumer."""
    client = aioredis.from_url(redis_url)
    try:
        summary = await client.xpending(feed_stream_key(stream), "trainer")
    finally:
        await client.aclose()
    return {consumer["name"].decode(): int(consumer["pending"]) for consumer in summary["consumers"]}


def step_log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / STEP_LOG).read_text().splitlines()]


def trainings(*logs: Path) -> Counter[int]:
    """How many times each step was trained, by what the trainers said ("step N: G group(s), ... training at")."""
    said = "".join(log.read_text() for log in logs)
    return Counter(int(step) for step in re.findall(r"\[trainer\] step (\d+): \d+ group\(s\), .* training at", said))


def by_step(groups: list[FeedGroup]) -> dict[int, list[FeedGroup]]:
    steps: dict[int, list[FeedGroup]] = {}
    for group in groups:
        steps.setdefault(group.step, []).append(group)
    return {step: sorted(members, key=lambda g: g.sample_index) for step, members in sorted(steps.items())}


def assert_equal_states(saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """Two AdamW state dicts: every moment and step count equal, exactly."""
    assert sorted(saved["state"]) == sorted(expected["state"]) and saved["state"]
    for index, moments in expected["state"].items():
        assert sorted(saved["state"][index]) == ["exp_avg", "exp_avg_sq", "step"]
        for name, tensor in moments.items():
            assert torch.equal(saved["state"][index][name], tensor), (index, name)


WINDOWS = ["before-the-update", "between-resume-and-record", "after-the-record", "after-the-ack"]


@pytest.mark.parametrize("window", WINDOWS)
async def test_a_trainer_killed_in_any_window_trains_each_group_once_and_adamw_goes_on(
    tiny_fleet, tiny_checkpoint, tmp_path, admin_stub, stoppable_redis, window
):
    redis = stoppable_redis
    stream = f"window-{window}"
    groups = by_step(await publish_steps(tiny_fleet, redis.url, stream, samples=2, steps=2))
    assert [len(step) for step in groups.values()] == [2, 2]
    out, first_log, second_log = tmp_path / "trainer", tmp_path / "first.log", tmp_path / "second.log"

    if window != "before-the-update":
        admin_stub.hold.set()
    if window == "between-resume-and-record":
        admin_stub.hold_resume.clear()
    if window == "after-the-record":
        admin_stub.on_resume = redis.stop  # the step is recorded, its acknowledgement never gets an answer
    first = await start_trainer(
        admin_stub,
        redis.url,
        stream,
        tiny_checkpoint,
        out,
        first_log,
        "--steps",
        "1" if window == "after-the-ack" else "2",
    )
    try:
        async with asyncio.timeout(180):
            if window == "before-the-update":
                await admin_stub.paused.wait()
            elif window == "between-resume-and-record":
                await admin_stub.resumed.wait()
            elif window == "after-the-record":
                while (state := TrainerState.load(out / STATE)) is None or state.intent is not None:  # noqa: ASYNC110 (another process writes it)
                    await asyncio.sleep(0.05)
            else:
                assert await first.wait() == 0, first_log.read_text()[-3000:]
    finally:
        await kill(first)
        redis.cont()

    # the window was hit: what the killed trainer left
    state = TrainerState.load(out / STATE)
    assert state is not None
    if window in ("before-the-update", "between-resume-and-record"):
        assert state.intent is not None and (state.intent.step, state.intent.version) == (0, 1)
        assert sorted(state.intent.group_ids) == sorted(g.group_id for g in groups[0])
        assert (Path(state.intent.weights) / OPTIMIZER).is_file()  # the optimizer's state beside the weights
        assert not (out / STEP_LOG).exists()
        assert admin_stub.version == (0 if window == "before-the-update" else 1)
        assert await pending(redis.url, stream) == {"trainer-0": 4}
    else:
        assert state.intent is None and (state.step, state.version) == (0, 1)
        assert [r["step"] for r in step_log(out)] == [0]
        left = await pending(redis.url, stream)
        if window == "after-the-record":  # its first acknowledgement may have been sent (Redis runs it once
            assert left in ({"trainer-0": 4}, {"trainer-0": 3})  # thawed), its second not
        else:
            assert left == {"trainer-0": 2}  # step 1's, read with step 0's

    # the restart: whatever it finishes first, then the next step
    admin_stub.answer_everything()
    # --steps counts the step a restart finishes: step 0 (when its record was missing), then step 1
    finishing = window in ("before-the-update", "between-resume-and-record")
    again = await start_trainer(
        admin_stub, redis.url, stream, tiny_checkpoint, out, second_log, "--steps", "2" if finishing else "1"
    )
    async with asyncio.timeout(180):
        assert await again.wait() == 0, second_log.read_text()[-3000:]

    records = step_log(out)
    assert [(r["step"], r["trained_version"], r["version"]) for r in records] == [(0, 0, 1), (1, 1, 2)]
    for record, step in zip(records, groups.values(), strict=True):
        assert sorted(record["group_ids"]) == sorted(g.group_id for g in step)  # each step once, whole
    assert records[0]["mismatch"]["current"]["max_abs"] == 0.0  # recorded from the killed trainer's training
    assert records[0].get("finished_after_restart", False) == finishing
    assert trainings(first_log, second_log) == {0: 1, 1: 1}  # each group trained once
    assert admin_stub.resumes == [1, 2]  # each update put on the fleet once
    assert admin_stub.pauses == (3 if window == "before-the-update" else 2)  # the held pause was sent again
    assert sum((await pending(redis.url, stream)).values()) == 0  # every group acknowledged
    assert "AdamW goes on from its state in" in second_log.read_text()
    final = TrainerState.load(out / STATE)
    assert final is not None and final.intent is None and (final.version, final.step) == (2, 1)

    # the same run never killed: the same weights and AdamW moments, bit for bit
    reference = GRPOLearner(tiny_checkpoint, CONFIG)
    for version, step in enumerate(groups.values(), start=1):
        reference.train_step([rollout for group in step for rollout in rollouts_of(group)])
        checkpoint = weights_dir(out, version)
        assert_equal_states(torch.load(checkpoint / OPTIMIZER, weights_only=True), reference.optimizer.state_dict())
        saved, expected = load_file(checkpoint / "model.safetensors"), reference.model.state_dict()
        assert len(saved) > 5 and set(saved) <= set(expected)  # every weight but the tied head's copy
        for name, tensor in saved.items():
            assert torch.equal(tensor, expected[name]), (version, name)
    assert reference.optimizer_steps == 2


async def test_a_trainer_killed_in_its_pause_is_finished_by_another_consumer(
    tiny_fleet, redis_url, tiny_checkpoint, tmp_path, admin_stub
):
    """A trainer started under another name: the dead one's intent is finished and its entries acknowledged by
    id (XACK is the group's), the rest claimed once idle ``--claim-idle-ms``."""
    stream = f"another-{os.getpid()}-{id(tmp_path)}"
    groups = await publish_steps(tiny_fleet, redis_url, stream, samples=3)
    out, first_log, second_log = tmp_path / "trainer", tmp_path / "first.log", tmp_path / "second.log"

    first = await start_trainer(admin_stub, redis_url, stream, tiny_checkpoint, out, first_log, "--steps", "1")
    try:
        async with asyncio.timeout(180):
            await admin_stub.paused.wait()  # inside its step: trained, weights and intent written, pausing
        assert (out / "weights" / "v000001" / "model.safetensors").is_file()
        assert await pending(redis_url, stream) == {"trainer-0": 3}  # read, not acknowledged
    finally:
        await kill(first)
    assert not (out / STEP_LOG).exists()

    admin_stub.hold.set()
    again = await start_trainer(
        admin_stub,
        redis_url,
        stream,
        tiny_checkpoint,
        out,
        second_log,
        "--steps",
        "1",
        "--consumer",
        "trainer-1",
        "--claim-idle-ms",
        "200",
    )
    async with asyncio.timeout(180):
        assert await again.wait() == 0, second_log.read_text()[-3000:]
    [record] = step_log(out)
    assert record["step"] == 0 and sorted(record["group_ids"]) == sorted(g.group_id for g in groups)
    assert trainings(first_log, second_log) == {0: 1}
    assert admin_stub.resumes == [1] and admin_stub.pauses == 2
    assert sum((await pending(redis_url, stream)).values()) == 0
    state = TrainerState.load(out / STATE)
    assert state is not None and state.intent is None
    assert (state.version, state.weights, state.step, sorted(state.group_ids)) == (
        1,
        record["weights"],
        0,
        sorted(record["group_ids"]),
    )


class Killed(Exception):
    """The trainer's process dying at this point (raised in-process; the restart reads only disk and Redis)."""


class AckFails(TrajectoryConsumer):
    """A consumer whose process dies at its first acknowledgement (after the record, before the ack)."""

    async def ack(self, entry: Any) -> None:
        raise Killed("the trainer died before acknowledging")


async def restart(stub: AdminStub, redis_url: str, stream: str, checkpoint: Path, out: Path) -> list[str]:
    """A new learner and trainer from what is on disk and in Redis (as the CLI starts), run until the feed is
    idle; what it said."""
    said: list[str] = []
    async with (
        ProxyClient(stub.url, ADMIN_KEY) as admin,
        TrajectoryConsumer(redis_url, stream=stream, block_ms=100, stop_when_idle=True) as feed,
    ):
        driver = FleetDriver(admin)
        start = await ResumePoint.read(driver, out)
        learner = GRPOLearner(start.weights or checkpoint, CONFIG)
        trainer = ReferenceTrainer(
            learner, feed, driver, out, version=start.version, state=start.state, keep_weights=1, log=said.append
        )
        await trainer.run()
    return said


@pytest.mark.parametrize("where", ["saving", "after-the-line", "inside-the-line", "acknowledging"])
async def test_a_crash_where_no_outside_part_can_hold_it(
    tiny_fleet, redis_url, tiny_checkpoint, tmp_path, admin_stub, monkeypatch, where
):
    """Inside the save (the checkpoint written, no intent yet: nothing left the process, so the restart
    trains the step again from the fleet's weights), after the step's line and before state.json's record,
    inside the line (cut short), and at the acknowledgement."""
    admin_stub.hold.set()
    stream = f"crash-{where}-{os.getpid()}-{id(tmp_path)}"
    groups = await publish_steps(tiny_fleet, redis_url, stream, samples=2)
    learner = GRPOLearner(tiny_checkpoint, CONFIG)
    if where == "saving":
        save = learner.save

        def save_then_die(directory: Path) -> None:
            save(directory)
            raise Killed("the trainer died with its checkpoint written, before its intent")

        monkeypatch.setattr(learner, "save", save_then_die)
    elif where in ("after-the-line", "inside-the-line"):
        record = ReferenceTrainer._save_state

        def record_then_die(trainer: ReferenceTrainer, state: TrainerState) -> None:
            if state.intent is None:  # the record after the step's line
                raise Killed("the trainer died between its step's line and state.json")
            record(trainer, state)

        monkeypatch.setattr(ReferenceTrainer, "_save_state", record_then_die)
    said: list[str] = []
    consumer = AckFails if where == "acknowledging" else TrajectoryConsumer
    async with (
        ProxyClient(admin_stub.url, ADMIN_KEY) as admin,
        consumer(redis_url, stream=stream, block_ms=100) as feed,
    ):
        crashing = ReferenceTrainer(learner, feed, FleetDriver(admin), tmp_path, version=0, log=said.append)
        with pytest.raises(Killed):
            await crashing.run(1)
    monkeypatch.undo()
    assert await pending(redis_url, stream) == {"trainer-0": 2}
    if where == "inside-the-line":
        line = (tmp_path / STEP_LOG).read_bytes()
        (tmp_path / STEP_LOG).write_bytes(line[: len(line) // 2])  # killed half-way through its write
    state = TrainerState.load(tmp_path / STATE)
    if where == "saving":
        assert state is None and (weights_dir(tmp_path, 1) / OPTIMIZER).is_file() and admin_stub.pauses == 0
        half_saved = tmp_path / "weights" / ".v000002.killed"  # what a kill inside another save leaves
        half_saved.mkdir()
        (half_saved / "model.safetensors").write_bytes(b"\0" * 1000)
    elif where == "acknowledging":
        assert state is not None and state.intent is None and len(step_log(tmp_path)) == 1
    else:
        assert state is not None and state.intent is not None and admin_stub.resumes == [1]

    said += await restart(admin_stub, redis_url, stream, tiny_checkpoint, tmp_path)
    [record] = step_log(tmp_path)  # the step once, whole
    assert record["step"] == 0 and sorted(record["group_ids"]) == sorted(g.group_id for g in groups)
    assert admin_stub.resumes == [1]
    assert sum((await pending(redis_url, stream)).values()) == 0
    trained = sum("training at version" in line for line in said)
    assert trained == (2 if where == "saving" else 1)  # a step that left nothing behind is trained again
    # the line the crashed trainer wrote is kept; one cut short is written again, whole, by the restart
    assert record.get("finished_after_restart", False) == (where == "inside-the-line")
    final = TrainerState.load(tmp_path / STATE)
    assert final is not None and final.intent is None and final.version == 1
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000001"]  # with its optimizer.pt
    assert (weights_dir(tmp_path, 1) / OPTIMIZER).is_file()


async def test_an_update_the_fleet_was_moved_past_stops_the_restart_in_words(tmp_path, admin_stub):
    """With an update under way and the fleet at neither its version nor the one it trained at, whether it
    reached the engines is unknown: the restart refuses to guess (it would train twice or skip an update)."""
    checkpoint = weights_dir(tmp_path, 4)
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    intent = StepIntent(7, 3, 4, str(checkpoint), ["g"], ["1-0"], {})
    TrainerState(3, str(weights_dir(tmp_path, 3)), 6, ["f"], ["0-0"], intent).save(tmp_path / STATE)
    admin_stub.version = 9
    async with ProxyClient(admin_stub.url, ADMIN_KEY) as admin:
        with pytest.raises(ResumeConflict, match=r"step 7's update from version 3 to 4 .* the fleet is at version 9"):
            await ResumePoint.read(FleetDriver(admin), tmp_path)
        admin_stub.version = 3
        assert (await ResumePoint.read(FleetDriver(admin), tmp_path)).weights == checkpoint
        shutil.rmtree(checkpoint)
        with pytest.raises(ResumeConflict, match=r"its checkpoint .* is gone"):
            await ResumePoint.read(FleetDriver(admin), tmp_path)
