"""``test_with_dataset`` over the shared execution helpers: what succeeds is scored, the rest skipped.

The plugins here make no model call, so no endpoint is needed: what is under test
is the loop (kinds, statuses, concurrency), not the inference proxy.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout_proxy.sdk import (
    GroupGraderResult,
    GroupRolloutResult,
    PluginStatus,
    RolloutResult,
    SingleGraderResult,
    SingleResponse,
    group_grader,
    group_rollout,
    rollout,
    single_grader,
    test_with_dataset,
)

ACTIVE = {"now": 0, "max": 0, "calls": 0}


def write_samples(path, behaviours):
    with path.open("w") as out:
        for index, behaviour in enumerate(behaviours):
            record = {"messages": [{"role": "user", "content": f"q{index}"}], "extra": {"b": behaviour, "score": index}}
            out.write(json.dumps(record) + "\n")
    return path


@rollout
async def scripted(context, proxy, sample):
    ACTIVE["now"] += 1
    ACTIVE["calls"] += 1
    ACTIVE["max"] = max(ACTIVE["max"], ACTIVE["now"])
    try:
        await asyncio.sleep(0.02)
        behaviour = sample.extra["b"]
        if behaviour == "raise":
            raise RuntimeError("plugin bug")
        if behaviour == "discard":
            return RolloutResult(status=PluginStatus.DISCARD)
        return RolloutResult(extra={"score": sample.extra["score"], "phase": context.phase})
    finally:
        ACTIVE["now"] -= 1


@single_grader
def score(context, sample, trajectory):
    if sample.extra["b"] == "grader_fails":
        return SingleGraderResult(reward=0.0, status=PluginStatus.FAILURE, error="judge down")
    assert trajectory.extra["phase"] == "test" and context.is_mock
    return SingleGraderResult(reward=float(trajectory.extra["score"]))


@group_rollout
def branches(context, proxy, sample, n_sample=1):
    if sample.extra["b"] == "raise":
        raise RuntimeError("plugin bug")
    return GroupRolloutResult(responses=[SingleResponse(id=f"r{i}", extra={"i": i}) for i in range(n_sample)])


@group_grader
def by_position(context, sample, trajectories):
    return GroupGraderResult(rewards=[sample.extra["score"] + t.extra["i"] / 10 for t in trajectories])


@pytest.fixture(autouse=True)
def reset():
    ACTIVE.update(now=0, max=0, calls=0)


async def test_rewards_of_what_succeeded_with_bounded_concurrency(tmp_path):
    behaviours = ["ok", "raise", "ok", "discard", "grader_fails", "ok", "ok"]
    path = write_samples(tmp_path / "d.jsonl", behaviours)
    rewards = await test_with_dataset(
        path, scripted, score, "key", "http://127.0.0.1:9/v1", max_concurrent=2, n_sample=2, progress=False
    )
    assert sorted(rewards) == [0.0, 0.0, 2.0, 2.0, 5.0, 5.0, 6.0, 6.0]
    assert ACTIVE["calls"] == 14 and ACTIVE["max"] == 2


async def test_limit_reads_only_the_first_samples(tmp_path):
    path = write_samples(tmp_path / "d.jsonl", ["ok"] * 5)
    rewards = await test_with_dataset(path, scripted, score, "key", "http://127.0.0.1:9/v1", limit=2, progress=False)
    assert sorted(rewards) == [0.0, 1.0] and ACTIVE["calls"] == 2


async def test_a_group_rollout_is_called_once_per_sample_and_graded_together(tmp_path):
    path = write_samples(tmp_path / "d.jsonl", ["ok", "raise", "ok"])
    rewards = await test_with_dataset(
        path, branches, by_position, "key", "http://127.0.0.1:9/v1", n_sample=3, progress=False
    )
    assert sorted(rewards) == pytest.approx([0.0, 0.1, 0.2, 2.0, 2.1, 2.2])


async def test_plugins_of_the_wrong_kind_are_refused(tmp_path):
    path = write_samples(tmp_path / "d.jsonl", ["ok"])
    with pytest.raises(TypeError, match="rollout must be"):
        await test_with_dataset(path, score, score, "key", "http://127.0.0.1:9/v1", progress=False)
    with pytest.raises(TypeError, match="grader must be"):
        await test_with_dataset(path, scripted, scripted, "key", "http://127.0.0.1:9/v1", progress=False)
