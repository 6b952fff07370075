"""A real job through the runner, then the viewer: its sessions, listed by job, with the rewards and
advantages the runner published to the feed this proxy serves (nothing handed over by the test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.runner import JobConfig, JobRunner
from rollout_proxy.state.feed import JsonlFeed
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.runner import runner_plugins
from tests.runner.conftest import weather_policy, write_dataset, write_job


async def test_a_jobs_sessions_are_listed_with_the_rewards_the_runner_published(tokenizer_dir: Path, tmp_path: Path):
    engine = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    engine.policy = weather_policy(engine)
    runner_plugins.CALLS.clear()
    runner_plugins.ACTIVE.update(now=0, max=0)
    feed_path = tmp_path / "feed.jsonl"
    async with (
        FakeEngineServer(engine) as url,
        ProxyHarness.running(engine_urls=[url], fake=engine, feed=f"jsonl:{feed_path}") as harness,
    ):
        dataset = write_dataset(tmp_path / "train.jsonl", ["ok", "ok"])
        job = JobConfig.load(
            write_job(tmp_path, dataset=dataset, graders=[("quality_grader", 1.0)], engine_url=url, batch_size=2)
        )
        runner = JobRunner(job, proxy_url=harness.url, admin_key=ADMIN_KEY, feed=JsonlFeed(feed_path), progress=False)
        summary = await runner.run()
        assert summary.groups_published == 2

        status, page = await harness.request("GET", "/v1/admin/sessions?job=weather-e2e")
        assert status == 200, page
        sessions = page["data"]
        assert len(sessions) == 2 * 3  # two samples, three single rollouts each
        published = {
            trajectory.response_id: (group.rewards[index], group.advantages[index])
            for entry in await JsonlFeed(feed_path).read(limit=10)
            for group in [entry.group]
            for index, trajectory in enumerate(group.trajectories)
        }
        for item in sessions:
            assert (item["status"], item["result_status"], item["step"]) == ("finished", "success", 0)
            (response_id,) = item["responses"]
            assert item["rewards"] == [published[response_id][0]]
            assert item["turns"] == 2 and item["finish_reasons"] == ["stop"]
        assert {reward for item in sessions for reward in item["rewards"]} == {0.0, 1.0}  # quality alternates

        status, rewarded = await harness.request("GET", "/v1/admin/sessions?min_reward=0.5")
        assert len(rewarded["data"]) == 3
        response_id = sessions[0]["responses"][0]
        status, tokens = await harness.request("GET", f"/v1/admin/responses/{response_id}/tokens")
        assert status == 200, tokens
        reward, advantage = published[response_id]
        assert tokens["grade"]["reward"] == reward and tokens["grade"]["advantage_kind"] == "grpo"
        assert tokens["grade"]["advantage"] == pytest.approx(advantage)
