"""A job end to end on the fake engine: statuses, grading, GRPO advantages, the feed."""

from __future__ import annotations

import json
import os

import pytest

from rollout_proxy.runner import JobConfig, JobFailed, run_job
from rollout_proxy.state.feed import JsonlFeed
from tests.runner import runner_plugins
from tests.runner.conftest import write_dataset, write_job

BEHAVIOURS = (
    ["ok"] * 4
    + ["discard", "retry_once", "ok", "raise_once", "ok", "retry_always"]
    + ["ok"] * 3
    + ["fail_once", "discard", "slow_once"]
    + ["ok"] * 4
)


def hand_grpo(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / 3
    std = ((sum((r - mean) ** 2 for r in rewards)) / 2) ** 0.5 + 1e-6
    return [(r - mean) / std for r in rewards]


async def test_job_over_twenty_samples(engine, tmp_path):
    assert len(BEHAVIOURS) == 20
    dataset = write_dataset(tmp_path / "train.jsonl", BEHAVIOURS)
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("quality_grader", 0.7), ("position_grader", 0.3)],
            engine_url=engine.url,
            num_steps=2,
        )
    )
    summary = await run_job(job, progress=False)

    assert os.environ["WEATHER_MODE"] == "fake"  # the plugin's envs were applied
    dropped = {i for i, b in enumerate(BEHAVIOURS) if b in ("discard", "retry_always")}
    assert summary.samples_done == 17 and summary.samples_dropped == 3 and summary.groups_published == 17
    assert summary.failed_attempts >= 4  # retry_once, raise_once, fail_once, slow_once (+ retry_always's)
    assert summary.drift == 0 and summary.trajectories == 51 and summary.turns == 102

    feed = JsonlFeed(summary.feed.removeprefix("jsonl:"))
    entries = [(entry.id, entry.group.model_dump(mode="json")) for entry in await feed.read(limit=1000)]
    assert [entry_id for entry_id, _ in entries] == [str(n) for n in range(1, 18)]
    published = [data["sample_index"] for _, data in entries]
    assert published == [i for i in range(20) if i not in dropped]  # in order, step by step
    for _, group in entries:
        index = group["sample_index"]
        assert group["step"] == index // 10 and group["group_id"] == f"weather-e2e/step-{index // 10}/sample-{index}"
        assert len(group["trajectories"]) == 3
        quality = index % 2
        expected_rewards = [0.7 * quality + 0.3 * 0.0, 0.7 * quality + 0.3 * 0.5, 0.7 * quality + 0.3 * 1.0]
        assert group["rewards"] == pytest.approx(expected_rewards)
        assert group["grader_rewards"] == {"quality": [float(quality)] * 3, "position": [0.0, 0.5, 1.0]}
        assert group["advantage_kind"] == "grpo"
        assert group["advantages"] == pytest.approx(hand_grpo(expected_rewards))
        for trajectory in group["trajectories"]:
            assert [m["role"] for m in trajectory["messages"]] == ["user", "assistant", "tool", "assistant"]
            assert (
                len(trajectory["total_token_ids"])
                == len(trajectory["total_loss_weight"])
                == len(trajectory["total_token_logprobs"])
            )
            assert sum(trajectory["total_loss_weight"]) > 0 and trajectory["extra"]["id"] == f"s{index}"

    # metrics per step: min / max / mean per key
    assert summary.step_metrics[0]["position/group_size"] == {"min": 3.0, "max": 3.0, "mean": 3.0}
    assert summary.step_metrics[1]["quality/turns"] == {"min": 2.0, "max": 2.0, "mean": 2.0}
    # Runtime bounds: 3 plugin calls and 2 model requests in flight at most
    assert runner_plugins.ACTIVE["max"] <= 3
    assert engine.max_inflight <= 2


async def test_failure_four_times_fails_the_job_with_the_plugins_error(engine, tmp_path):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok", "fail_always", "ok"])
    job = JobConfig.load(
        write_job(tmp_path, dataset=dataset, graders=[("quality_grader", 1.0)], engine_url=engine.url, batch_size=3)
    )
    with pytest.raises(JobFailed, match="failed 4 times; last error: the weather API key is invalid"):
        await run_job(job, progress=False)
    # the feed was opened (its file made, so a path that cannot be written fails first), nothing published in it
    assert (tmp_path / "out" / "weather-e2e" / "feed.jsonl").read_bytes() == b""


async def test_a_rerun_resumes_without_publishing_twice(engine, tmp_path):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 4)
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("quality_grader", 1.0)],
            engine_url=engine.url,
            batch_size=2,
            num_generations=2,
        )
    )
    first = await run_job(job, progress=False)
    second = await run_job(job, progress=False)
    assert first.groups_published == 4 and second.groups_published == 0 and second.samples_resumed == 4
    lines = (tmp_path / "out" / "weather-e2e" / "feed.jsonl").read_text().splitlines()
    assert len(lines) == 4 and len({json.loads(line)["group_id"] for line in lines}) == 4


async def test_a_crash_between_grading_and_publishing_loses_nothing(engine, tmp_path, monkeypatch):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 4)
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("quality_grader", 1.0)],
            engine_url=engine.url,
            batch_size=2,
            num_generations=2,
        )
    )
    original = JsonlFeed.publish
    published = []

    async def crash_after_first(self, group):
        if published:
            raise OSError("the runner's machine lost power")
        published.append(group.group_id)
        return await original(self, group)

    monkeypatch.setattr(JsonlFeed, "publish", crash_after_first)
    with pytest.raises(OSError):
        await run_job(job, progress=False)
    monkeypatch.setattr(JsonlFeed, "publish", original)
    summary = await run_job(job, progress=False)
    assert summary.samples_resumed == 1 and summary.groups_published == 3
    lines = [json.loads(line) for line in (tmp_path / "out" / "weather-e2e" / "feed.jsonl").read_text().splitlines()]
    assert sorted(line["data"]["sample_index"] for line in lines) == [0, 1, 2, 3]


async def test_custom_advantages_for_some_groups_of_a_batch_fail_the_job(engine, tmp_path):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 2, extra=lambda i: {"custom": i == 0})
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("custom_grader", 1.0)],
            engine_url=engine.url,
            batch_size=2,
            num_generations=2,
        )
    )
    with pytest.raises(JobFailed, match="1 of 2 groups carry custom advantages"):
        await run_job(job, progress=False)


async def test_custom_advantages_replace_grpo(engine, tmp_path):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 2, extra=lambda i: {"custom": True})
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("custom_grader", 1.0)],
            engine_url=engine.url,
            batch_size=2,
            num_generations=2,
        )
    )
    summary = await run_job(job, progress=False)
    entries = [
        (e.id, e.group.model_dump(mode="json")) for e in await JsonlFeed(summary.feed.removeprefix("jsonl:")).read()
    ]
    assert all(group["advantage_kind"] == "seq" and group["advantages"] == [0.5, 0.5] for _, group in entries)


async def test_grader_statuses_follow_the_same_rules(engine, tmp_path):
    graders = {0: "ok", 1: "discard", 2: "retry_once", 3: "ok"}
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 4, extra=lambda i: {"grader": graders[i]})
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("moody_grader", 1.0)],
            engine_url=engine.url,
            batch_size=4,
            num_generations=1,
        )
    )
    summary = await run_job(job, progress=False)
    assert summary.samples_done == 3 and summary.samples_dropped == 1 and summary.failed_attempts == 1
    entries = [
        (e.id, e.group.model_dump(mode="json")) for e in await JsonlFeed(summary.feed.removeprefix("jsonl:")).read()
    ]
    assert [group["sample_index"] for _, group in entries] == [0, 2, 3]


@pytest.mark.parametrize("mode, message", [("fail", "the judge model is down"), ("raise", "ValueError: grader bug")])
async def test_a_grader_failing_four_times_fails_the_job(engine, tmp_path, mode, message):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"], extra=lambda i: {"grader": mode})
    job = JobConfig.load(
        write_job(
            tmp_path,
            dataset=dataset,
            graders=[("moody_grader", 1.0)],
            engine_url=engine.url,
            batch_size=1,
            num_generations=1,
        )
    )
    with pytest.raises(JobFailed, match=f"grader moody failed 4 times; last error: {message}"):
        await run_job(job, progress=False)
