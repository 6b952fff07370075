"""One test per result rule, each with the error text a plugin author needs."""

from __future__ import annotations

import math

import pytest

from rollout_proxy.sdk import (
    ChatCompletionMessage,
    CriticContext,
    GroupGraderResult,
    GroupRolloutResult,
    PluginValidationError,
    RolloutResult,
    SingleGraderResult,
    SingleResponse,
    TeacherContext,
    group_grader,
    group_rollout,
    rollout,
    single_grader,
)
from rollout_proxy.sdk.validation import check_advantage_batch

TRAJECTORIES = [
    {"messages": [], "total_token_ids": [1, 2, 3], "total_loss_weight": [0, 1, 1]},
    {"messages": [], "total_token_ids": [1, 2], "total_loss_weight": [0, 1]},
]


def grade(**result):
    @group_grader
    def grader(context, sample, trajectories):
        return GroupGraderResult(**{"rewards": [0.0, 1.0], "metrics": {}, "status": "success", "error": "", **result})

    return grader({}, {}, TRAJECTORIES)


def test_group_rollout_must_return_n_sample_responses():
    @group_rollout
    def group(context, proxy, sample, n_sample=1):
        return GroupRolloutResult(responses=[SingleResponse(id="resp_a"), SingleResponse(id="resp_b")])

    with pytest.raises(PluginValidationError, match="exactly n_sample=3 responses, got 2"):
        group({}, None, {}, n_sample=3)
    assert len(group({}, None, {}, n_sample=2).responses) == 2


def test_a_failed_group_may_return_no_responses():
    @group_rollout
    def group(context, proxy, sample, n_sample=1):
        return GroupRolloutResult(status="failure", error="tool down")

    assert group({}, None, {}, n_sample=4).status == "failure"


def test_not_both_kinds_of_advantages():
    with pytest.raises(PluginValidationError, match="either seq_advantages or tok_advantages"):
        grade(seq_advantages=[0.0, 0.0], tok_advantages=[[0.0] * 3, [0.0] * 2])


def test_seq_advantages_one_per_trajectory():
    with pytest.raises(PluginValidationError, match="seq_advantages has 3 values for 2 trajectories"):
        grade(seq_advantages=[0.0, 0.0, 0.0])


def test_tok_advantages_one_list_per_trajectory():
    with pytest.raises(PluginValidationError, match="tok_advantages has 1 lists for 2 trajectories"):
        grade(tok_advantages=[[0.0, 0.0, 0.0]])


def test_tok_advantages_one_value_per_token():
    with pytest.raises(PluginValidationError, match=r"tok_advantages\[1\] has 3 values but trajectory 1 has 2 tokens"):
        grade(tok_advantages=[[0.0] * 3, [0.0] * 3])


def test_tok_advantages_of_a_rollout_with_branches_are_one_list_per_sequence():
    """A trajectory with branches (a subagent: 2 tokens, a compaction: 4) is a rollout of three sequences."""
    branches = [{"total_token_ids": [7, 8], "total_loss_weight": [0, 1]}, {"total_token_ids": [1] * 4}]
    trajectories = [{**TRAJECTORIES[0], "branches": branches}, TRAJECTORIES[1]]

    def grade_branches(tok_advantages):
        @group_grader
        def grader(context, sample, trajectories):
            return GroupGraderResult(rewards=[0.0, 1.0], tok_advantages=tok_advantages)

        return grader({}, {}, trajectories)

    per_sequence = [[[0.0] * 3, [1.0] * 2, [2.0] * 4], [[0.5] * 2]]  # any rollout may use the per-sequence form
    assert grade_branches(per_sequence).tok_advantages == per_sequence
    with pytest.raises(PluginValidationError, match=r"tok_advantages\[0\]: a flat list of 3 .* rollout of 3 sequences"):
        grade_branches([[0.0] * 3, [0.0] * 2])  # the seed's flat form fits a rollout of one sequence only
    with pytest.raises(PluginValidationError, match=r"tok_advantages\[0\]\[2\]: 3 per-token advantages for 4 tokens"):
        grade_branches([[[0.0] * 3, [1.0] * 2, [2.0] * 3], [[0.5] * 2]])
    with pytest.raises(PluginValidationError, match=r"tok_advantages\[0\]\[1\]\[0\] is nan"):
        grade_branches([[[0.0] * 3, [math.nan, 1.0], [2.0] * 4], [[0.5] * 2]])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_advantages_must_be_finite(bad):
    with pytest.raises(PluginValidationError, match=r"seq_advantages\[1\] is .*finite"):
        grade(seq_advantages=[0.0, bad])
    with pytest.raises(PluginValidationError, match=r"tok_advantages\[0\]\[2\]|tok_advantages\[0\]"):
        grade(tok_advantages=[[0.0, 0.0, bad], [0.0, 0.0]])


def test_rewards_one_per_trajectory_and_finite():
    with pytest.raises(PluginValidationError, match="rewards has 1 values for 2 trajectories"):
        grade(rewards=[1.0])
    with pytest.raises(PluginValidationError, match=r"rewards\[0\] is nan"):
        grade(rewards=[math.nan, 1.0])

    @single_grader
    def single(context, sample, trajectory):
        return SingleGraderResult(reward=math.inf)

    with pytest.raises(PluginValidationError, match=r"reward\[0\] is inf"):
        single({}, {}, {"messages": []})


def test_custom_advantages_all_or_none_in_a_batch():
    plain = GroupGraderResult(rewards=[1.0], metrics={}, status="success", error="")
    custom = GroupGraderResult(rewards=[1.0], metrics={}, status="success", error="", seq_advantages=[0.0])
    check_advantage_batch([plain, plain])
    check_advantage_batch([custom, custom])
    with pytest.raises(PluginValidationError, match="1 of 2 groups in this batch return custom advantages"):
        check_advantage_batch([custom, plain])


class FakeProxy:
    def __init__(self, assistant_turns: int) -> None:
        self.messages = [{"role": "user", "content": "q"}] + [{"role": "assistant", "content": "a"}] * assistant_turns


def rollout_returning(config):
    @rollout
    def plugin(context, proxy, sample):
        return RolloutResult(config=config)

    return plugin


def teacher(qa_index, content="the reference steps"):
    message = ChatCompletionMessage(role="user", content=content)
    return {
        "teachers": {
            "teacher_math": {
                "teacher_context": [TeacherContext(qa_index=qa_index, message=message).model_dump(exclude_none=True)]
            }
        }
    }


def critic(qa_index, content="reference answer: 4"):
    message = ChatCompletionMessage(role="user", content=content)
    return {"critic_context": [CriticContext(qa_index=qa_index, message=message).model_dump(exclude_none=True)]}


def test_teacher_context_qa_index_within_assistant_turns():
    assert rollout_returning(teacher(1))({}, FakeProxy(2), {}).config["teachers"]
    with pytest.raises(PluginValidationError, match=r"qa_index=2 is outside the trajectory's assistant turns \(0..1\)"):
        rollout_returning(teacher(2))({}, FakeProxy(2), {})


def test_critic_context_qa_index_within_assistant_turns():
    with pytest.raises(PluginValidationError, match="qa_index=-1 is outside"):
        rollout_returning(critic(-1))({}, FakeProxy(1), {})


def test_contexts_must_be_text_only():
    with pytest.raises(PluginValidationError, match=r"message.content must be text \(a string\), not list"):
        rollout_returning(critic(0, content=[{"type": "image_url", "image_url": {"url": "x"}}]))({}, FakeProxy(1), {})


def test_one_teacher_per_trajectory():
    config = {"teachers": {"teacher_math": {}, "teacher_code": {}}}
    with pytest.raises(PluginValidationError, match="at most one teacher per trajectory"):
        rollout_returning(config)({}, FakeProxy(1), {})


def test_teacher_context_not_longer_than_the_turns():
    config = teacher(0)
    config["teachers"]["teacher_math"]["teacher_context"] *= 3
    with pytest.raises(PluginValidationError, match="has 3 entries but the trajectory has only 2 assistant turns"):
        rollout_returning(config)({}, FakeProxy(2), {})


def test_wrong_return_type_is_named():
    @single_grader
    def grader(context, sample, trajectory):
        return 0.5

    with pytest.raises(PluginValidationError, match="must return a SingleGraderResult, got float"):
        grader({}, {}, {"messages": []})
