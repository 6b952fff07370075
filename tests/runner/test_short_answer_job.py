"""The demo's job (short answers) on the fake engine: mixed answers, mixed rewards, non-zero advantages."""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources

import pytest

from devtools.fake_engine import FakeEngine
from rollout_proxy.examples.short_answer import grade_reply, short_answer_reward
from rollout_proxy.runner import JobConfig, run_job
from rollout_proxy.runner.grading import grpo_advantages
from rollout_proxy.sdk import ChatCompletionSample, PluginContext, Trajectory
from rollout_proxy.state.feed import JsonlFeed
from tests.runner.test_summary_plot import png_size


@pytest.mark.parametrize(
    ("reply", "answers", "reward"),
    [
        ("Paris", ["Paris"], 1.0),
        ("paris.", ["Paris"], 1.0),
        ("It is Paris", ["Paris"], 0.5),  # right, in a short reply
        ("The capital of France is Paris.", ["Paris"], 0.0),  # right, but not a short answer
        ("Luxembourg", ["Paris"], 0.0),
        ("", ["Paris"], 0.0),
        ("five", ["5"], 1.0),  # number words count as numbers
        ("5 apples", ["5"], 0.5),
        ("15", ["5"], 0.0),  # a number is a whole word, not a digit inside one
        ("Kitten!", ["cat", "kitten"], 1.0),  # aliases
    ],
)
def test_the_grader_checks_the_answer_and_its_shortness(reply, answers, reward):
    assert grade_reply(reply, answers)[0] == reward


def test_the_grader_plugin_reads_the_last_assistant_message():
    sample = ChatCompletionSample(
        messages=[{"role": "user", "content": "What animal says meow?"}], extra={"answer": "cat", "aliases": ["kitten"]}
    )
    trajectory = Trajectory(messages=[*sample.message_dicts(), {"role": "assistant", "content": "A cat"}])
    result = short_answer_reward(PluginContext(), sample, trajectory)
    assert result.reward == 0.5 and result.metrics["correct"] == 1.0 and result.metrics["exact"] == 0.0


def answer_policy(fake: FakeEngine, answers: dict[str, str]):
    """Each question's n-th ask gets the n-th of: the answer, it in a short phrase, no answer, it shouted."""
    asked: Counter[str] = Counter()

    def policy(prompt_ids: list[int]) -> str:
        question = fake.decode(prompt_ids).split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        answer = answers[question]
        asked[question] += 1
        return [answer, f"It is {answer}", "I don't know", f"{answer.upper()}!"][(asked[question] - 1) % 4]

    return policy


def demo_job() -> tuple[JobConfig, dict[str, str]]:
    """The bundled job, and its dataset's answer to each question."""
    with resources.as_file(resources.files("rollout_proxy.examples") / "short_answer_job.yaml") as job_file:
        job = JobConfig.load(job_file)
    dataset = [json.loads(line) for line in job.dataset_files()[0].read_text().splitlines()]
    return job, {record["messages"][-1]["content"]: record["extra"]["answer"] for record in dataset}


async def test_the_demo_job_gives_mixed_rewards_and_non_zero_advantages(engine, tmp_path):
    job, answers = demo_job()
    engine.policy = answer_policy(engine, answers)
    hyper = job.hyperparameters
    summary = await run_job(job, engines=[engine.url], output_dir=tmp_path, progress=False)

    samples = hyper.num_steps * hyper.batch_size
    assert summary.samples_done == samples and summary.trajectories == samples * hyper.num_generations
    # every group: one of each answer, so the same rewards in some order, and GRPO advantages not all zero
    entries = [entry.group.model_dump(mode="json") for entry in await JsonlFeed(summary.feed[6:]).read(limit=100)]
    assert len(entries) == samples
    for group in entries:
        assert sorted(group["rewards"]) == [0.0, 0.5, 1.0, 1.0]
        assert group["advantages"] == pytest.approx(grpo_advantages(group["rewards"]))
        assert min(group["advantages"]) < 0 < max(group["advantages"])
    assert summary.groups_graded == summary.groups_with_signal == samples
    assert summary.mean_abs_advantage > 0.5
    assert (summary.reward_min, summary.reward_max, summary.mean_reward) == (0.0, 1.0, 0.625)
    text = summary.render()
    assert "mean reward   0.6250 (min 0.0000, max 1.0000, std 0.4146)" in text
    assert f"{samples} of {samples} group(s) with rewards that differ (non-zero advantages)" in text
    # the in-process proxy's viewer (where this proxy serves one) is gone with the job: the summary says so
    assert bool(summary.viewer_note) == bool(summary.viewer) and (summary.viewer or "/ui").endswith("/ui")
    # the plot, next to the feed
    plot = tmp_path / job.name / "steps.png"
    assert summary.plot == str(plot) and f"plot          {plot}" in text and png_size(plot) == (800, 600)
