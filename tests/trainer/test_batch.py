"""Feed groups → rollouts → padded micro-batches: alignment, advantages per rollout, every trained token once."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_proxy.trainer.batch import (
    NO_VERSION,
    BatchError,
    Rollout,
    TrainSequence,
    dropped_counts,
    micro_batches,
    rollouts_of,
    trained_tokens,
)
from rollout_proxy.wire.feed import FeedGroup
from rollout_proxy.wire.trajectory import PolicyVersionSpan, RolloutCounts, Trajectory


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
    with pytest.raises(BatchError, match="rollout 0, sequence 0: 3 per-token advantages for 4 tokens"):
        rollouts_of(group([trajectory(2, [7, 2])], [[0.0, 1.5, -2.0]], kind="tok"))
    # the same rollout's advantages as one list per sequence (the form for any rollout) mean the same
    nested = rollouts_of(group([trajectory(2, [7, 2])], [[[0.0, 0.0, 1.5, -2.0]]], kind="tok"))
    assert nested[0].advantages(nested[0].sequences[0]).tolist() == [0.0, 0.0, 1.5, -2.0]


def rollout_with_branches() -> Trajectory:
    """A main sequence and two branches (a subagent, a rewrite that shares the main's first turn, weighted 0)."""
    main = trajectory(3, [7, 8, 2]).model_copy(
        update={"response_id": "resp_main", "branch": {"kind": "new_conversation"}, "main": True}
    )
    subagent = trajectory(2, [9, 2], first=300).model_copy(
        update={"response_id": "resp_sub", "branch": {"kind": "new_conversation", "label": "subagent"}}
    )
    rewrite = trajectory(3, [7, 8, 2, 5, 6, 2]).model_copy(
        update={"response_id": "resp_edit", "branch": {"kind": "rewrite", "at_message": 2}}
    )
    rewrite.total_loss_weight[3:6] = [0.0] * 3  # the shared first turn: the main sequence trains it
    rewrite.total_token_logprobs[3:6] = [0.0] * 3
    return main.model_copy(update={"branches": [subagent, rewrite]})


def test_every_sequence_of_a_rollout_is_trained_with_the_rollouts_advantage():
    whole = rollout_with_branches()
    [rollout] = rollouts_of(group([whole], [0.25]))
    assert [len(s) for s in rollout.sequences] == [6, 4, 9]
    assert [(s.response_id, s.branch) for s in rollout.sequences] == [
        ("resp_main", "new_conversation"),
        ("resp_sub", "new_conversation"),
        ("resp_edit", "rewrite"),
    ]
    assert [s.trained.tolist() for s in rollout.sequences][2] == [False] * 6 + [True] * 3
    for sequence, member in zip(rollout.sequences, whole.sequences(), strict=True):
        assert sequence.token_ids.tolist() == member.total_token_ids
        assert sequence.trained.sum() == sum(member.total_loss_weight or [])
        assert (rollout.advantages(sequence) == 0.25).all()
    assert trained_tokens([rollout]) == 3 + 2 + 3
    batches = micro_batches([rollout], max_tokens=100)
    assert sorted(ref.sequence for batch in batches for ref in batch.rows) == [0, 1, 2]
    assert sum(float(batch.loss_weight.sum()) for batch in batches) == 8.0
    assert all((batch.advantages[batch.loss_weight > 0] == 0.25).all() for batch in batches)


def test_token_advantages_of_a_rollout_with_branches_are_one_list_per_sequence():
    whole = rollout_with_branches()
    rows = [[float(i) for i in range(6)], [-1.0] * 4, [2.0] * 9]
    [rollout] = rollouts_of(group([whole], [rows], kind="tok"))
    assert [rollout.advantages(s).tolist() for s in rollout.sequences] == rows
    [(_, _, first), (_, _, second), (_, _, third)] = group([whole], [rows], kind="tok").sequence_advantages()
    assert [first, second, third] == rows
    with pytest.raises(BatchError, match="rollout 0: a flat list of 6 per-token advantages for a rollout of 3"):
        rollouts_of(group([whole], [rows[0]], kind="tok"))
    with pytest.raises(BatchError, match=r"rollout 0, sequence 1 \(resp_sub, new_conversation\): 3 per-token"):
        rollouts_of(group([whole], [[rows[0], [0.0] * 3, rows[2]]], kind="tok"))
    with pytest.raises(BatchError, match="2 lists of per-token advantages for a rollout of 3 sequences"):
        rollouts_of(group([whole], [rows[:2]], kind="tok"))


def test_a_broken_branch_is_refused_with_its_place():
    whole = rollout_with_branches()
    whole.branches[1].total_loss_weight = [0.0, 1.0]
    with pytest.raises(BatchError, match=r"rollout 0, sequence 2 \(resp_edit, rewrite\): 9 token ids, 2 loss"):
        rollouts_of(group([whole], [0.0]))


def test_the_rollout_counts_bring_the_dropped_retries_and_catch_a_lost_branch():
    whole = rollout_with_branches()
    counts = RolloutCounts(sequences=3, sampled_tokens=12, trained_tokens=8, dropped_tokens=4, dropped_sequences=1)
    [rollout] = rollouts_of(group([whole.model_copy(update={"rollout_counts": counts})], [1.0]))
    assert (rollout.dropped_sequences, rollout.dropped_tokens) == (1, 4)
    assert dropped_counts([rollout, rollout]) == {"dropped_sequences": 2, "dropped_tokens": 8}
    assert dropped_counts(rollouts_of(group([whole], [1.0]))) == {"dropped_sequences": 0, "dropped_tokens": 0}
    lost = whole.model_copy(update={"rollout_counts": counts, "branches": whole.branches[:1]})
    with pytest.raises(BatchError, match="counts 3 sequences and 8 trained tokens, the feed carries 2 sequences and 5"):
        rollouts_of(group([lost], [1.0]))


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
    with pytest.raises(BatchError, match=f"group job/step-0/sample-0, rollout 1, sequence 0: .*{message}"):
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
