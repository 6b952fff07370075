"""Feed groups → rollouts → padded micro-batches: alignment, advantages per rollout, every trained token once."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_proxy.trainer.batch import (
    NO_VERSION,
    BatchError,
    Rollout,
    TrainSequence,
    micro_batches,
    rollouts_of,
    trained_tokens,
)
from rollout_proxy.wire.feed import FeedGroup
from rollout_proxy.wire.trajectory import PolicyVersionSpan, Trajectory


def trajectory(prompt: int, reply: list[int], *, version: int = 3, first: int = 100) -> Trajectory:
    ids = list(range(first, first + prompt)) + reply
    return Trajectory(
        total_token_ids=ids,
        total_loss_weight=[0.0] * prompt + [1.0] * len(reply),
        total_token_logprobs=[0.0] * prompt + [-0.5 - i for i in range(len(reply))],
        policy_versions=[PolicyVersionSpan(version=version, start=prompt, end=prompt + len(reply))],
    )


def group(trajectories: list[Trajectory], advantages: list, **fields) -> FeedGroup:
    return FeedGroup(
        group_id="job/step-0/sample-0",
        job_id="job",
        step=0,
        sample_index=0,
        trajectories=trajectories,
        rewards=[1.0] * len(trajectories),
        advantages=advantages,
        advantage_kind=fields.pop("kind", "grpo"),
        **fields,
    )


def test_a_trajectory_is_one_rollout_of_one_sequence_with_its_advantage():
    rollouts = rollouts_of(group([trajectory(4, [7, 8, 2]), trajectory(5, [9, 2])], [0.5, -0.5]))
    assert [(r.index, r.advantage, len(r.sequences)) for r in rollouts] == [(0, 0.5, 1), (1, -0.5, 1)]
    [sequence] = rollouts[0].sequences
    assert sequence.token_ids.tolist() == [100, 101, 102, 103, 7, 8, 2]
    assert sequence.trained.tolist() == [False] * 4 + [True] * 3
    assert sequence.versions.tolist() == [NO_VERSION] * 4 + [3] * 3
    assert rollouts[0].advantages(sequence).tolist() == [0.5] * 7
    assert trained_tokens(rollouts) == 5


def test_token_advantages_are_taken_per_token():
    rollouts = rollouts_of(group([trajectory(2, [7, 2])], [[0.0, 0.0, 1.5, -2.0]], kind="tok"))
    assert rollouts[0].advantage is None
    assert rollouts[0].advantages(rollouts[0].sequences[0]).tolist() == [0.0, 0.0, 1.5, -2.0]
    with pytest.raises(BatchError, match="3 token advantages for 4 tokens"):
        rollouts_of(group([trajectory(2, [7, 2])], [[0.0, 1.5, -2.0]], kind="tok"))


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({"total_loss_weight": [0.0, 1.0]}, "must align"),
        ({"total_token_logprobs": [0.0]}, "must align"),
        ({"total_loss_weight": [1.0, 0.0, 1.0, 1.0]}, "first token is trained"),
        ({"policy_versions": [PolicyVersionSpan(version=1, start=2, end=9)]}, "outside its 4 tokens"),
    ],
)
def test_a_trajectory_the_trainer_cannot_use_is_refused_with_its_place(broken, message):
    bad = trajectory(2, [7, 2]).model_copy(update=broken)
    with pytest.raises(BatchError, match=f"group job/step-0/sample-0, trajectory 1: .*{message}"):
        rollouts_of(group([trajectory(2, [7, 2]), bad], [0.0, 0.0]))
    with pytest.raises(BatchError, match="2 trajectories, 2 rewards, 1 advantages"):
        rollouts_of(group([trajectory(2, [7, 2]), trajectory(2, [7, 2])], [0.0]))


def sequence(length: int, trained_from: int) -> TrainSequence:
    weight = np.zeros(length, np.float32)
    weight[trained_from:] = 1.0
    logprobs = np.where(weight > 0, -np.arange(length, dtype=np.float32), 0.0).astype(np.float32)
    versions = np.where(weight > 0, 5, NO_VERSION)
    return TrainSequence(np.arange(1, length + 1), weight, logprobs, versions)


def test_a_rollout_of_several_sequences_gives_each_its_advantage():
    """What the feed will carry for subagents and compaction branches: several sequences, one reward."""
    rollout = Rollout("g", 0, 1.0, 0.75, (sequence(6, 3), sequence(4, 1), sequence(3, 3)))  # the last: none trained
    [batch] = micro_batches([rollout], max_tokens=100)
    assert [ref.sequence for ref in batch.rows] == [0, 1]  # a sequence with nothing trained is left out
    assert (batch.advantages[batch.loss_weight > 0] == 0.75).all()


def test_micro_batches_hold_every_trained_sequence_once_within_the_token_budget():
    rollouts = [Rollout("g", i, 0.0, float(i), (sequence(length, 2),)) for i, length in enumerate([5, 9, 3, 9, 7, 4])]
    batches = micro_batches(rollouts, max_tokens=20)
    rows = [ref.rollout for batch in batches for ref in batch.rows]
    assert sorted(rows) == list(range(6))
    assert rows == [1, 3, 4, 0, 5, 2]  # longest first (ties in order): little padding
    for batch in batches:
        assert batch.input_ids.size <= 20
        assert batch.input_ids.shape[1] == batch.lengths.max()
    assert micro_batches(rollouts, max_tokens=1) and all(
        len(b.rows) == 1 for b in micro_batches(rollouts, max_tokens=1)
    )


def test_padded_rows_keep_each_array_aligned_with_its_tokens():
    rollouts = [Rollout("g", 0, 0.0, 2.0, (sequence(6, 4),)), Rollout("g", 1, 0.0, -1.0, (sequence(4, 2),))]
    [batch] = micro_batches(rollouts, max_tokens=100, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert batch.loss_weight.tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert batch.sampling_logprobs.tolist() == [[0, 0, 0, 0, -4, -5], [0, 0, -2, -3, 0, 0]]
    assert batch.advantages[1, :4].tolist() == [-1.0] * 4 and batch.advantages[1, 4:].tolist() == [0.0, 0.0]
    assert batch.versions[0].tolist() == [NO_VERSION] * 4 + [5, 5]
    assert batch.trained_span == (2, 6)
