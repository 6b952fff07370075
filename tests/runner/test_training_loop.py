"""The training loop: runner → feed → the example trainer → pause, new version, resume → runner.

Two fake engines behind a proxy, the runner and ``examples.trainer`` on one loop, a Redis feed.
The fake engines record which weight version sampled each token, so "no step starts too early"
is checked against what the engines did, not only against what the proxy recorded.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.embedded import serve_app
from rollout_proxy.engines.vllm_http import EngineRejected, VLLMEngine
from rollout_proxy.examples.trainer import ExampleTrainer
from rollout_proxy.runner import JobConfig, JobError, JobFailed, run_job
from rollout_proxy.runner.admin import AdminClient
from rollout_proxy.runner.job import TrainingLoop
from rollout_proxy.runner.progress import JobProgress
from rollout_proxy.runner.runner import JobRunner
from rollout_proxy.runner.staleness import StalenessGate, is_stale
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.state.feed import open_feed
from rollout_proxy.trainer import TrajectoryConsumer
from rollout_proxy.wire.feed import FeedGroup
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.runner import loop_plugins

SAMPLE = re.compile(r"Question number (\d+)\b")


def write_job(
    tmp_path: Path, *, samples: int, batch_size: int, graders: list[str], training_loop: dict[str, Any]
) -> JobConfig:
    dataset = tmp_path / "train.jsonl"
    with dataset.open("w") as out:
        for index in range(samples):
            out.write(json.dumps({"messages": [{"role": "user", "content": f"Question number {index} please"}]}) + "\n")
    raw = {
        "name": "loop",
        "custom_rl_pipeline": {
            "rollout": {"plugin": {"python_func": "tests.runner.loop_plugins:two_turns"}},
            "graders": [{"plugin": {"python_func": f"tests.runner.loop_plugins:{name}"}} for name in graders],
        },
        "data": {"training_set": {"local_files": [str(dataset)]}},
        "hyperparameters": {"num_generations": 2, "max_new_tokens": 16, "batch_size": batch_size},
        "training_loop": training_loop,
    }
    return JobConfig.parse(raw, base_dir=tmp_path)


@pytest.fixture
async def fleet(tokenizer_dir: Path) -> AsyncIterator[tuple[ProxyHarness, list[FakeEngine]]]:
    """A proxy in front of two fake engines, each on its own port, ~50 ms per completion."""
    engines = [FakeEngine(tokenizer_dir, delay=0.05), FakeEngine(tokenizer_dir, delay=0.05)]
    loop_plugins.STARTS.clear()
    loop_plugins.BUMP.clear()
    async with (
        FakeEngineServer(engines[0]) as first,
        FakeEngineServer(engines[1]) as second,
        ProxyHarness.running(engine_urls=[first, second]) as proxy,
    ):
        yield proxy, engines


async def feed_groups(redis_url: str, stream: str) -> list[FeedGroup]:
    feed = await open_feed(redis_url, stream=stream)
    try:
        return [entry.group for entry in await feed.read(limit=1000)]
    finally:
        await feed.close()


def engine_versions(engines: list[FakeEngine], batch_size: int) -> list[tuple[int, int]]:
    """(step, weight version) of every token the engines sampled; the step from the sample in the prompt."""
    seen = []
    for engine in engines:
        for generation in engine.generations:
            match = SAMPLE.search(engine.decode(generation.prompt))
            assert match, "every prompt names its sample"
            step = int(match.group(1)) // batch_size
            for version, start, end in generation.versions:
                seen += [(step, 0 if version == "default" else int(version))] * (end - start)
    return seen


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_runner_trainer_and_proxy_in_a_loop(fleet, redis_url, tmp_path, max_staleness):
    proxy, engines = fleet
    steps, batch_size = 3, 3
    job = write_job(
        tmp_path,
        samples=steps * batch_size,
        batch_size=batch_size,
        graders=["length_grader"],
        training_loop={"max_staleness": max_staleness, "version_wait": 60, "poll_interval": 0.05},
    )
    stream = f"loop-{secrets.token_hex(4)}"
    runner_feed = await open_feed(redis_url, stream=stream)
    runner = JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=runner_feed, progress=False)
    async with (
        ProxyClient(proxy.url, ADMIN_KEY) as admin,
        TrajectoryConsumer(redis_url, stream=stream, block_ms=100) as consumer,
    ):
        # "training" takes 1 s: with max_staleness 1 the runner does not wait for it
        trainer = ExampleTrainer(admin, consumer, pause_mode="keep", train_seconds=1.0)
        try:
            summary, updates = await _together(runner.run(), trainer.run(steps))
        finally:
            await runner_feed.close()

    # the trainer trained once per step, on the whole step, and moved the fleet one version each time
    assert [(u.step, u.groups, u.version) for u in updates] == [(k, batch_size, k + 1) for k in range(steps)]
    assert (await proxy.request("GET", "/v1/admin/engines", token=ADMIN_KEY))[1]["policy_version"] == steps

    # no step started too early: by the engines' own record of which weights sampled each token ...
    for step, version in engine_versions(engines, batch_size):
        assert step - max_staleness <= version <= step, (step, version)
    # ... and by the clock: step k's rollouts began after the trainer paused for version k - S
    first_start = {k: min(t for s, t in loop_plugins.STARTS if s == k) for k in range(steps)}
    for k in range(1, steps):
        if k - max_staleness >= 1:
            assert first_start[k] > updates[k - max_staleness - 1].paused_at
    if max_staleness == 1:  # and it did not wait when it need not: step 1 rolled out while step 0 trained
        assert first_start[1] < updates[0].resumed_at

    # every group within bounds; nothing published twice, nothing lost
    groups = await feed_groups(redis_url, stream)
    assert sorted(g.group_id for g in groups) == sorted(f"loop/step-{i // batch_size}/sample-{i}" for i in range(9))
    sessions = [t.session_id for g in groups for t in g.trajectories]
    assert len(sessions) == len(set(sessions)) == steps * batch_size * 2
    for group in groups:
        versions = [span.version for t in group.trajectories for span in t.policy_versions]
        assert (group.oldest_policy_version, group.newest_policy_version) == (min(versions), max(versions))
        assert group.step - max_staleness <= group.oldest_policy_version <= group.newest_policy_version <= group.step
        assert group.step_groups == batch_size and not group.stale
    assert summary.groups_published == 9 and summary.stale_dropped == summary.stale_kept == 0
    assert summary.max_staleness == max_staleness and "staleness     max" in summary.render()


async def _together(run: Any, train: Any) -> tuple[Any, Any]:
    """The runner and the trainer at once; the first failure of either ends both."""
    async with asyncio.timeout(120):
        async with asyncio.TaskGroup() as tasks:
            ran, trained = tasks.create_task(run), tasks.create_task(train)
    return ran.result(), trained.result()


@pytest.mark.parametrize("stale_groups", ["drop", "keep"])
async def test_stale_groups_are_dropped_or_kept_and_marked(fleet, redis_url, tmp_path, stale_groups):
    """A version bump while step 0 is graded makes all of step 0 one version old at publication."""
    proxy, _ = fleet
    job = write_job(
        tmp_path,
        samples=4,
        batch_size=2,
        graders=["bumping_grader"],
        training_loop={"max_staleness": 0, "stale_groups": stale_groups, "version_wait": 30, "poll_interval": 0.05},
    )
    loop_plugins.BUMP.update(url=proxy.url, admin_key=ADMIN_KEY, version=1)
    stream = f"stale-{secrets.token_hex(4)}"
    feed = await open_feed(redis_url, stream=stream)
    try:
        summary = await JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
    finally:
        await feed.close()
    groups = await feed_groups(redis_url, stream)
    step1 = [g for g in groups if g.step == 1]
    assert len(step1) == 2 and all(not g.stale and g.oldest_policy_version == 1 for g in step1)
    step0 = [g for g in groups if g.step == 0]
    if stale_groups == "drop":
        assert step0 == [] and (summary.stale_dropped, summary.stale_kept) == (2, 0)
    else:
        assert len(step0) == 2 and all(g.stale and g.newest_policy_version == 0 for g in step0)
        assert (summary.stale_dropped, summary.stale_kept) == (0, 2)
    assert summary.samples_done == 4  # graded either way: dropping is the feed's business, not grading's


async def test_a_trainer_that_never_resumes_fails_the_job_in_bounded_time(fleet, redis_url, tmp_path):
    proxy, engines = fleet
    job = write_job(
        tmp_path,
        samples=4,
        batch_size=2,
        graders=["length_grader"],
        training_loop={"max_staleness": 0, "version_wait": 1.0, "poll_interval": 0.05},
    )
    feed = await open_feed(redis_url, stream=f"nobody-{secrets.token_hex(4)}")
    started = time.monotonic()
    try:
        with pytest.raises(JobFailed, match=r"step 1 needs policy version 1 or newer .* stayed at 0 for 1s"):
            await JobRunner(job, proxy_url=proxy.url, admin_key=ADMIN_KEY, feed=feed, progress=False).run()
    finally:
        await feed.close()
    assert time.monotonic() - started < 30  # bounded by version_wait (1 s), generous margin
    assert {step for step, _ in loop_plugins.STARTS} == {0}  # step 1 never started
    assert {step for step, _ in engine_versions(engines, 2)} == {0}


async def test_a_proxy_that_is_down_hung_or_without_fleet_api_fails_the_wait(tmp_path):
    loop = TrainingLoop(max_staleness=0, version_wait=0.5, poll_interval=0.05)
    async with AdminClient("http://127.0.0.1:9", "key") as down:  # nothing listens: refused
        with pytest.raises(JobFailed, match="did not say its policy version in time"):
            await StalenessGate(down, loop).start()

    hung = web.Application()  # accepts, does not answer: the wait still ends at version_wait
    released = asyncio.Event()

    async def never(request: web.Request) -> web.Response:
        await released.wait()
        return web.json_response({"policy_version": 0})

    hung.router.add_get("/v1/admin/engines", never)
    runner, url = await serve_app(hung)
    try:
        async with AdminClient(url, "key") as admin:
            started = time.monotonic()
            with pytest.raises(JobFailed, match="did not say its policy version in time"):
                await StalenessGate(admin, loop).start()
            assert time.monotonic() - started < 10  # version_wait is 0.5 s; generous margin
    finally:
        released.set()
        await runner.cleanup()

    app = web.Application()  # a proxy without GET /v1/admin/engines (an older one): no wait helps
    runner, url = await serve_app(app)
    try:
        async with AdminClient(url, "key") as old:
            started = time.monotonic()
            with pytest.raises(JobFailed, match="needs the proxy's fleet API"):
                await StalenessGate(old, loop).start()
            assert time.monotonic() - started < 10  # at once: version_wait (0.5 s) would not help it
    finally:
        await runner.cleanup()


def test_staleness_rule():
    assert not is_stale(5, 5, 0) and is_stale(5, 4, 0)
    assert not is_stale(5, 4, 1) and is_stale(5, 3, 1)
    assert not is_stale(5, None, 0)  # no generated tokens: nothing can be old


def test_progress_says_which_version_it_waits_for():
    progress = JobProgress(total=1, enabled=False)
    progress.waiting(7)
    assert progress._bar.desc.startswith("waiting for policy version 7")  # tqdm adds ": "
    progress.waiting(None)
    assert progress._bar.desc.startswith("samples")


def test_training_loop_fields_in_the_job_file(tmp_path):
    job = write_job(tmp_path, samples=1, batch_size=1, graders=["length_grader"], training_loop={})
    assert job.training_loop.max_staleness is None and job.training_loop.stale_groups == "drop"  # no gating
    job = write_job(
        tmp_path,
        samples=1,
        batch_size=1,
        graders=["length_grader"],
        training_loop={"max_staleness": 2, "stale_groups": "keep", "initial_policy_version": 10},
    )
    assert (job.training_loop.max_staleness, job.training_loop.stale_groups) == (2, "keep")
    for bad, where in [
        ({"max_staleness": -1}, "training_loop.max_staleness"),
        ({"stale_groups": "maybe"}, "training_loop.stale_groups"),
        ({"version_wait": 0}, "training_loop.version_wait"),
        ({"max_stalenes": 1}, "training_loop.max_stalenes: unknown field"),
    ]:
        with pytest.raises(JobError, match=re.escape(where)):
            write_job(tmp_path, samples=1, batch_size=1, graders=["length_grader"], training_loop=bad)


async def test_a_gated_job_needs_a_proxy_a_trainer_can_reach(tmp_path):
    """An in-process proxy's admin key is nobody's: its version would never move, so the job is refused at once."""
    job = write_job(tmp_path, samples=2, batch_size=1, graders=["length_grader"], training_loop={"max_staleness": 0})
    with pytest.raises(JobError, match="--proxy-url"):
        await run_job(job, progress=False, feed=f"jsonl:{tmp_path / 'feed.jsonl'}")
    assert not (tmp_path / "feed.jsonl").exists()


async def test_the_trainer_reloads_every_paused_engine_or_leaves_the_fleet_paused(fleet, redis_url, monkeypatch):
    """``--weights``: each paused engine reloads (vLLM's /collective_rpc, which the fake serves); one that
    fails must not resume at the new version, so the trainer stops with the fleet paused."""
    proxy, _ = fleet
    async with (
        ProxyClient(proxy.url, ADMIN_KEY) as admin,
        TrajectoryConsumer(redis_url, stream=f"reload-{secrets.token_hex(4)}") as consumer,
    ):
        trainer = ExampleTrainer(admin, consumer, weights="/checkpoints/step-1")
        await trainer.train_step(0, [])
        fleet_now = (await proxy.request("GET", "/v1/admin/engines", token=ADMIN_KEY))[1]
        assert fleet_now["policy_version"] == 1 and not fleet_now["paused"]

        reloaded: list[str] = []

        async def flaky(self: VLLMEngine, weights_path: str, *, within: float) -> None:
            reloaded.append(self.url)
            if len(reloaded) == 2:
                raise EngineRejected("collective_rpc reload_weights: 500", engine_status=500)

        monkeypatch.setattr(VLLMEngine, "reload_weights", flaky)  # the client the trainer reloads with
        with pytest.raises(RuntimeError, match="failed on 1 engine"):
            await trainer.train_step(1, [])
        fleet_now = (await proxy.request("GET", "/v1/admin/engines", token=ADMIN_KEY))[1]
        assert sorted(reloaded) == sorted(engine["url"] for engine in fleet_now["engines"])  # each paused one
        assert fleet_now["policy_version"] == 1 and fleet_now["paused"]  # not resumed at version 2
