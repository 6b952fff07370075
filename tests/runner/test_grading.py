"""Grading a group with several graders: weights, names, metrics, custom advantages, retries."""

from __future__ import annotations

import pytest

from rollout_proxy.runner.grading import Graders
from rollout_proxy.runner.retries import JobFailed, SampleDropped
from rollout_proxy.sdk import (
    ChatCompletionSample,
    GroupGraderResult,
    PluginContext,
    PluginStatus,
    SingleGraderResult,
    Trajectory,
    group_grader,
    single_grader,
)

SAMPLE = ChatCompletionSample.model_validate({"messages": [{"role": "user", "content": "q"}], "extra": {}})
CONTEXT = PluginContext(phase="train", current_training_step=0)
GROUP = [Trajectory(messages=[], extra={"n": n}, total_token_ids=[1] * (n + 1)) for n in range(3)]
CALLS: dict[str, int] = {}


@single_grader(name="parity")
def parity(context, sample, trajectory):
    CALLS["parity"] = CALLS.get("parity", 0) + 1
    status = sample.extra.get("parity", "success")
    if status == "retry_once" and CALLS["parity"] == 1:
        return SingleGraderResult(reward=0.0, status=PluginStatus.RETRY, error="busy")
    if status in ("failure", "discard"):
        return SingleGraderResult(reward=0.0, status=PluginStatus(status), error=f"{status}!")
    return SingleGraderResult(reward=float(trajectory.extra["n"] % 2), metrics={"n": float(trajectory.extra["n"])})


@group_grader(name="rank")
def rank(context, sample, trajectories):
    n = len(trajectories)
    return GroupGraderResult(rewards=[i / (n - 1) for i in range(n)], metrics={"size": float(n)})


@group_grader(name="custom")
def custom(context, sample, trajectories):
    return GroupGraderResult(rewards=[1.0] * len(trajectories), seq_advantages=[1.0, 0.0, -1.0])


@group_grader(name="tokens")
def tokens(context, sample, trajectories):
    advantages = [[0.5] * len(t.total_token_ids) for t in trajectories]
    return GroupGraderResult(rewards=[0.0] * len(trajectories), tok_advantages=advantages)


@pytest.fixture(autouse=True)
def reset():
    CALLS.clear()


def sample(**extra) -> ChatCompletionSample:
    return SAMPLE.model_copy(update={"extra": extra})


async def test_rewards_are_weighted_and_kept_by_grader():
    grade = await Graders([(parity, 0.7), (rank, 0.3)]).grade_group("s0", CONTEXT, SAMPLE, GROUP)
    assert grade.rewards == pytest.approx([0.0, 0.7 + 0.15, 0.3])
    assert grade.grader_rewards == {"parity": [0.0, 1.0, 0.0], "rank": [0.0, 0.5, 1.0]}
    assert grade.metrics == [{"parity/n": 0.0}, {"parity/n": 1.0}, {"parity/n": 2.0}, {"rank/size": 3.0}]
    assert grade.custom is None


async def test_custom_advantages_are_weighted_and_sequence_ones_spread_over_tokens():
    seq = await Graders([(custom, 1.0), (rank, 1.0)]).grade_group("s0", CONTEXT, SAMPLE, GROUP)
    assert seq.custom == ("seq", [1.0, 0.0, -1.0])
    mixed = await Graders([(custom, 1.0), (tokens, 3.0)]).grade_group("s0", CONTEXT, SAMPLE, GROUP)
    kind, advantages = mixed.custom
    assert kind == "tok" and advantages == [[0.625], [0.375, 0.375], [0.125, 0.125, 0.125]]


BRANCHED = [
    GROUP[0].model_copy(
        update={"branches": [Trajectory(total_token_ids=[2] * 2), Trajectory(total_token_ids=[3] * 3)]}
    ),
    GROUP[1],
]


@group_grader(name="per_sequence")
def per_sequence(context, sample, trajectories):
    advantages = [[[float(k)] * len(s.total_token_ids) for k, s in enumerate(t.sequences())] for t in trajectories]
    return GroupGraderResult(rewards=[0.0] * len(trajectories), tok_advantages=advantages)


@group_grader(name="seq_pair")
def seq_pair(context, sample, trajectories):
    return GroupGraderResult(rewards=[0.0, 0.0], seq_advantages=[1.0, -1.0])


async def test_token_advantages_are_per_sequence_of_a_rollout_with_branches():
    """A rollout of three sequences (its main one and two branches) beside one of one sequence."""
    grade = await Graders([(per_sequence, 1.0), (seq_pair, 1.0)]).grade_group("s0", CONTEXT, SAMPLE, BRANCHED)
    kind, advantages = grade.custom
    # each sequence gets its own row, the sequence-level advantage spread over each sequence's tokens; a rollout
    # of one sequence keeps the seed's flat form
    assert kind == "tok"
    assert advantages == [[[0.5], [1.0, 1.0], [1.5, 1.5, 1.5]], [-0.5, -0.5]]


async def test_a_grader_saying_retry_is_called_again_and_counted():
    failed = []
    graders = Graders([(parity, 1.0)], on_failed_attempt=lambda: failed.append(1))
    grade = await graders.grade_group("s0", CONTEXT, sample(parity="retry_once"), GROUP)
    assert grade.rewards == [0.0, 1.0, 0.0] and CALLS["parity"] == 4 and failed == [1]


async def test_a_discarding_grader_drops_the_sample_and_a_failing_one_fails_the_job():
    with pytest.raises(SampleDropped, match="s0: grader parity: discarded: discard!"):
        await Graders([(rank, 1.0), (parity, 1.0)]).grade_group("s0", CONTEXT, sample(parity="discard"), GROUP)
    with pytest.raises(JobFailed, match="s0: grader parity failed 4 times; last error: failure!"):
        await Graders([(parity, 1.0)]).grade_group("s0", CONTEXT, sample(parity="failure"), GROUP)
