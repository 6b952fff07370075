"""A session's tree as one rollout (``core.branches``): branch kinds, sequences, every sampled token once.

Trees are built by hand (plain ``ResponseNode``s, oldest first, as ``get_nodes`` returns them), so
each rule is checked on its own: kinds, which leaves make sequences, which sequence trains a shared
node, what ``retry: drop`` drops, and the token counts.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollout_proxy.core.branches import BranchKind, branch_label, branches, rollout
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.records import NodeKind, ResponseNode

_ids = itertools.count()


def node(
    parent: ResponseNode | None,
    inputs: list[str],
    *,
    output: int = 3,
    kind: NodeKind = NodeKind.GENERATED,
    fork: dict | None = None,
    label: str | None = None,
) -> ResponseNode:
    number = next(_ids)
    messages = [{"role": "user", "content": text} for text in inputs]
    if kind is NodeKind.GENERATED:
        messages.append({"role": "assistant", "content": f"answer {number}"})
    return ResponseNode(
        id=f"resp_{number}",
        parent_id=None if parent is None else parent.id,
        kind=kind,
        api="chat",
        messages=messages,
        n_input_messages=len(inputs),
        prompt_ids=np.full(2, number, dtype=np.int32),
        output_ids=np.full(output if kind is NodeKind.GENERATED else 0, 1000 + number, dtype=np.int32),
        output_logprobs=np.full(output if kind is NodeKind.GENERATED else 0, -0.25, dtype=np.float32),
        created_at=float(number),
        fork=fork,
        meta={} if label is None else {"branch_label": label},
    )


@pytest.fixture
def harness_tree() -> dict[str, ResponseNode]:
    """Main agent, a subagent, main again, a compaction retried and continued, an edited turn."""
    main1 = node(None, ["system", "task"])
    sub1 = node(None, ["sub system", "sub task"], label="subagent-1")
    sub2 = node(sub1, ["go on"], output=5)
    main2 = node(main1, ["next"], output=4)
    compact = node(None, ["system", "task", "summary"], fork={"diverged_from": main1.id, "at_message": 2})
    compact_again = node(None, ["system", "task", "summary"], fork={"diverged_from": main1.id, "at_message": 2})
    compact2 = node(compact_again, ["after the summary"], output=6)
    edited = node(main1, ["next, edited"], output=2)
    tool_result = node(edited, ["a tool result"], kind=NodeKind.INJECTED)
    return {name: value for name, value in locals().items() if isinstance(value, ResponseNode)}


def ordered(tree: dict[str, ResponseNode]) -> list[ResponseNode]:
    return sorted(tree.values(), key=lambda n: n.created_at)


def test_every_node_says_how_it_relates_to_the_tree(harness_tree):
    t = harness_tree
    found = branches(ordered(t))
    assert {name: found[n.id].kind for name, n in t.items()} == {
        "main1": BranchKind.NEW_CONVERSATION,
        "sub1": BranchKind.NEW_CONVERSATION,
        "sub2": BranchKind.CONTINUATION,
        "main2": BranchKind.CONTINUATION,
        "compact": BranchKind.REWRITE,
        "compact_again": BranchKind.RETRY,
        "compact2": BranchKind.CONTINUATION,
        "edited": BranchKind.CONTINUATION,
        "tool_result": BranchKind.CONTINUATION,
    }
    assert found[t["compact"].id].to_json() == {
        "kind": "rewrite",
        "label": None,
        "from": t["main1"].id,
        "at_message": 2,
    }
    assert found[t["compact_again"].id].from_ == t["compact"].id
    assert found[t["sub1"].id].label == "subagent-1" and found[t["main2"].id].from_ == t["main1"].id


@pytest.mark.parametrize("retry", ["drop", "keep"])
def test_every_sampled_token_is_trained_in_exactly_one_sequence(harness_tree, retry):
    t = harness_tree
    nodes = ordered(t)
    plan = rollout(nodes, retry=retry)
    leaves = [sequence.leaf.id for sequence in plan.sequences]
    # one per generated leaf: the main one (the latest leaf) first, then oldest first, dropped ones last
    expected = ["edited", "sub2", "main2", "compact", "compact2"]
    if retry == "drop":
        expected = ["edited", "sub2", "main2", "compact2", "compact"]
    assert leaves == [t[name].id for name in expected]
    assert [sequence.main for sequence in plan.sequences] == [True, False, False, False, False]
    trained_by: dict[str, list[int]] = {}
    for index, sequence in enumerate(plan.sequences):
        assert sequence.trained <= {n.id for n in sequence.path}
        for node_id in sequence.trained:
            trained_by.setdefault(node_id, []).append(index)
    generated = [n for n in nodes if n.kind is NodeKind.GENERATED]
    compact = t["compact"].id
    for n in generated:
        times = len(trained_by.get(n.id, []))
        assert times == (0 if retry == "drop" and n.id == compact else 1), n.id
    # the main sequence trains its whole path (what a single trajectory trained before branches)
    assert plan.sequences[0].trained == {n.id for n in plan.sequences[0].path if n.kind is NodeKind.GENERATED}
    sampled = sum(len(n.output_ids) for n in generated)
    assert plan.sampled_tokens == sampled
    assert plan.trained_tokens + plan.dropped_tokens == sampled
    assert plan.dropped_tokens == (len(t["compact"].output_ids) if retry == "drop" else 0)
    dropped = [sequence for sequence in plan.sequences if sequence.dropped]
    assert [sequence.leaf.id for sequence in dropped] == ([compact] if retry == "drop" else [])
    assert all(not sequence.trained for sequence in dropped)


def test_shared_nodes_are_weighted_zero_where_another_sequence_trains_them(harness_tree):
    t = harness_tree
    plan = rollout(ordered(t))
    by_leaf = {sequence.leaf.id: sequence for sequence in plan.sequences}
    edited, main2 = by_leaf[t["edited"].id], by_leaf[t["main2"].id]
    assert t["main1"].id in edited.trained and t["main1"].id not in main2.trained  # main1 is on both paths
    trajectory = assemble("sess", main2.path, trained=main2.trained)
    weights, logprobs = trajectory.total_loss_weight, trajectory.total_token_logprobs
    # main1's output (after its 2 prompt tokens) weighted 0, main2's (after its 2) weighted 1
    assert weights.tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert logprobs.tolist() == [0, 0, 0, 0, 0, 0, 0, -0.25, -0.25, -0.25, -0.25]
    assert [span.to_dict() for span in trajectory.policy_versions] == []  # the hand-built nodes carry none
    # trailing injected messages are no leaf of their own and left off the sequence
    assert edited.leaf.id == t["edited"].id


def test_a_retry_no_conversation_went_on_from_keeps_the_latest():
    first = node(None, ["task"])
    again = node(None, ["task"])
    plan = rollout([first, again])
    assert [(s.leaf.id, s.dropped, s.main) for s in plan.sequences] == [
        (again.id, False, True),
        (first.id, True, False),
    ]
    assert branches([first, again])[again.id].kind is BranchKind.RETRY


def test_an_empty_session_has_no_sequence():
    plan = rollout([])
    assert plan.sequences == [] and plan.main is None and plan.sampled_tokens == plan.trained_tokens == 0
    only_injected = node(None, ["hello"], kind=NodeKind.INJECTED)
    assert rollout([only_injected]).sequences == []


def test_an_unknown_retry_policy_is_refused():
    with pytest.raises(ValueError, match="retry must be one of"):
        rollout([], retry="sometimes")


@pytest.mark.parametrize(
    ("header", "metadata", "expected"),
    [
        (None, None, None),
        ("subagent-2", {"rollout_branch": "ignored"}, "subagent-2"),
        (None, {"rollout_branch": "compaction"}, "compaction"),
        (None, {"other": "x"}, None),
    ],
)
def test_a_request_labels_its_branch_by_header_or_metadata(header, metadata, expected):
    assert branch_label(header, metadata) == expected


@pytest.mark.parametrize("bad", ["", "x" * 201, "line\nbreak", 7])
def test_a_bad_branch_label_is_refused(bad):
    with pytest.raises(ValueError, match="branch label"):
        branch_label(None, {"rollout_branch": bad})
