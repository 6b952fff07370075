"""The trainer's fixtures: a tiny checkpoint, and a proxy over a fake engine that samples with it."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.runner import JobConfig
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.state.feed import open_feed
from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.trainer.fleet import FleetDriver
from rollout_proxy.trainer.loop import Learner, ReferenceTrainer
from rollout_proxy.wire.feed import FeedGroup
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.runner.test_short_answer_job import answer_policy


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from tests.trainer.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "v0")


@dataclass
class TinyFleet:
    proxy: ProxyHarness
    engine: FakeEngine
    weights: Any  # tiny.EngineWeights (imports torch)
    answers: dict[str, str]


def short_answer_job(
    *, samples: int, generations: int, steps: int, training_loop: dict[str, Any], grader: str | None = None
) -> JobConfig:
    """The demo's job at the given sizes, its steps tied to the trainer (``grader``: another one's python_func)."""
    with resources.as_file(resources.files("rollout_proxy.examples") / "short_answer_job.yaml") as job_file:
        job = JobConfig.load(job_file)
    if grader is not None:
        job.custom_rl_pipeline.graders[0].plugin.python_func = grader
        job.custom_rl_pipeline.graders[0].plugin.name = None
    job.hyperparameters.batch_size = samples
    job.hyperparameters.num_generations = generations
    job.hyperparameters.num_steps = steps
    job.training_loop = job.training_loop.model_validate({"version_wait": 60, "poll_interval": 0.05, **training_loop})
    return job


def dataset_answers(job: JobConfig) -> dict[str, str]:
    records = [json.loads(line) for line in job.dataset_files()[0].read_text().splitlines()]
    return {record["messages"][-1]["content"]: record["extra"]["answer"] for record in records}


@pytest.fixture
async def tiny_fleet(tokenizer_dir: Path, tiny_checkpoint: Path) -> AsyncIterator[TinyFleet]:
    """A proxy over one fake engine that samples with the tiny checkpoint (scripted short answers)."""
    from tests.trainer.tiny import EngineWeights

    weights = EngineWeights(tiny_checkpoint)
    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], delay=0.01, model=weights)
    answers = dataset_answers(short_answer_job(samples=1, generations=1, steps=1, training_loop={}))
    engine.policy = answer_policy(engine, answers)
    async with FakeEngineServer(engine) as url, ProxyHarness.running(engine_urls=[url]) as proxy:
        yield TinyFleet(proxy, engine, weights, answers)


@pytest.fixture
async def tiny_lora_fleet(tokenizer_dir: Path, tiny_checkpoint: Path) -> AsyncIterator[TinyFleet]:
    """``tiny_fleet`` with run-time LoRA on the engine (``--max-lora-rank 16``): a call naming an adapter samples
    with the tiny checkpoint and that adapter (peft)."""
    from tests.trainer.tiny import EngineWeights

    weights = EngineWeights(tiny_checkpoint)
    engine = FakeEngine(
        tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], delay=0.01, model=weights, max_lora_rank=16
    )
    answers = dataset_answers(short_answer_job(samples=1, generations=1, steps=1, training_loop={}))
    engine.policy = answer_policy(engine, answers)
    async with FakeEngineServer(engine) as url, ProxyHarness.running(engine_urls=[url]) as proxy:
        yield TinyFleet(proxy, engine, weights, answers)


async def run_loop(
    proxy: ProxyHarness,
    redis_url: str,
    job: JobConfig,
    learner: Learner,
    out_dir: Path,
    *,
    steps: int,
    threshold: float = 1e-2,
) -> LoopRun:
    """The runner and the reference trainer together on a fresh Redis stream, until both are done."""
    stream = f"train-{secrets.token_hex(4)}"
    feed = await open_feed(redis_url, stream=stream)
    runner = JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False)
    async with (
        ProxyClient(proxy.url, ADMIN_KEY) as admin,
        TrajectoryConsumer(redis_url, stream=stream, block_ms=100) as consumer,
    ):
        driver = FleetDriver(admin)
        trainer = ReferenceTrainer(
            learner, consumer, driver, out_dir, version=await driver.version(), threshold=threshold, log=lambda _: None
        )
        try:
            async with asyncio.timeout(300):
                async with asyncio.TaskGroup() as tasks:
                    ran = tasks.create_task(runner.run())
                    tasks.create_task(trainer.run(steps))
        finally:
            await feed.close()
    return LoopRun(ran.result(), trainer, stream)


@dataclass
class LoopRun:
    summary: Any  # the runner's JobSummary
    trainer: ReferenceTrainer
    stream: str

    async def groups(self, redis_url: str, step: int | None = None) -> list[FeedGroup]:
        """The groups on the feed (of one step), in order."""
        feed = await open_feed(redis_url, stream=self.stream)
        try:
            groups = [entry.group for entry in await feed.read(limit=10_000)]
        finally:
            await feed.close()
        return [group for group in groups if step is None or group.step == step]
