"""A job whose rollouts branch (a subagent, a compaction retried): the feed carries every sequence.

A rollout that names no responses publishes all its sequences: graders see them (the main one marked),
the feed carries them on their rollout, a group's advantages are per rollout, and the trainer, reading
the feed's sequences, trains every token the engine sampled exactly once (``retry: keep``; with the
default ``drop`` the retry the conversation did not go on from is left out).
"""

from __future__ import annotations

import pytest
import yaml

from rollout_proxy.runner import JobConfig, run_job
from rollout_proxy.state.feed import JsonlFeed
from tests.runner.conftest import write_dataset, write_job


@pytest.mark.parametrize("retry", ["keep", "drop"])
async def test_every_sampled_token_reaches_the_trainer_once(engine, tmp_path, retry):
    dataset = write_dataset(tmp_path / "train.jsonl", ["ok"] * 2)
    path = write_job(tmp_path, dataset=dataset, graders=[("sequences_grader", 1.0)], engine_url=engine.url)
    job = yaml.safe_load(path.read_text())
    job["custom_rl_pipeline"]["rollout"]["plugin"] = {
        "name": "branching_rollout",
        "python_func": "tests.runner.branch_plugins:branching_rollout",
    }
    job["custom_rl_pipeline"]["graders"][0]["plugin"]["python_func"] = "tests.runner.branch_plugins:sequences_grader"
    job["hyperparameters"].update(num_generations=2, batch_size=2)
    job["proxy"]["retry"] = retry
    path.write_text(yaml.safe_dump(job))
    summary = await run_job(JobConfig.load(path), progress=False)
    assert summary.samples_done == 2 and summary.groups_published == 2

    feed = JsonlFeed(summary.feed.removeprefix("jsonl:"))
    groups = [entry.group for entry in await feed.read(limit=100)]
    trained = 0
    for group in groups:
        assert len(group.trajectories) == 2 and group.advantage_kind == "grpo" and len(group.advantages) == 2
        for rollout_index, sequence in group.sequences():
            assert sequence.session_id == group.trajectories[rollout_index].session_id
            trained += int(sum(sequence.total_loss_weight or []))
        # the main agent's two turns, the subagent, the compaction (and its retry, kept or not)
        assert group.rewards == [3.0 if retry == "drop" else 4.0] * 2
    generated = sum(len(generation.tokens) for generation in engine.generations)
    if retry == "keep":
        assert trained == generated
    else:
        # each rollout sent the compaction twice; the engine's policy answers one prompt alike, so the dropped
        # retry's tokens are half of what the compactions sampled
        retried = [g for g in engine.generations if "Summary:" in engine.decode(g.prompt)]
        assert len(retried) == 8 and len({tuple(g.tokens) for g in retried}) <= 4
        assert trained == generated - sum(len(g.tokens) for g in retried) // 2
