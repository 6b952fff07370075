"""Assemble a trajectory from a root-to-leaf path, in one pass over its nodes.

``AssembledTrajectory`` holds numpy arrays; ``to_json`` gives exactly the fields of the
wire schema ``rollout_proxy.wire.Trajectory`` (what graders, the runner and trainers
parse), with the arrays serialized as they are.

Loss weight is 1.0 exactly on tokens the policy sampled and 0.0 elsewhere (prompt,
bridge, injected messages); the logprob is the sampling logprob where the weight is
1 and 0.0 elsewhere. A rollout's sequence (``core.branches``) trains only some of its
generated nodes: the tokens of the others (trained in another sequence, or dropped) are
weighted 0 with logprob 0.0 too. ``policy_versions`` says which policy and which version of it
sampled each generated token (trained here or not): half-open spans over ``total_token_ids``,
adjacent spans of one policy and version merged; prompt, bridge and injected tokens are in none.
``images`` says where each image's placeholder span is in ``total_token_ids`` (its hash names its bytes in the
session's image store): spans lie in prompt tokens, so their loss weight is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_proxy.records import ImageSpan, NodeKind, PolicySpan, ResponseNode, TopLogprobs, merge_spans
from rollout_proxy.routing import assemble_routing
from rollout_proxy.wire.arrays import encode_array
from rollout_proxy.wire.routed_experts import encode_routed_experts


@dataclass(slots=True)
class AssembledTrajectory:
    response_id: str
    session_id: str
    messages: list[dict[str, Any]]
    finish_reason: str | None
    usage: dict[str, int]
    extra: dict[str, Any]
    total_token_ids: np.ndarray  # int32
    total_loss_weight: np.ndarray  # float32
    total_token_logprobs: np.ndarray  # float32
    routed_experts: np.ndarray | None = None  # (T, layers, top_k) int16, -1 where unobserved
    turns: int = 0
    forks: list[dict[str, Any]] = field(default_factory=list)
    routing_disagreements: int = 0
    policy_versions: list[PolicySpan] = field(default_factory=list)
    images: list[ImageSpan] = field(default_factory=list)  # each image's span in ``total_token_ids``, in order
    trace_ids: list[str | None] = field(default_factory=list)  # each generated turn's request's trace
    # on-policy distillation (``core.teacher``): set by the runner from the teacher pass, None without one
    teacher: str | None = None
    total_teacher_logprobs: list[float | None] | None = None
    teacher_topk: dict[str, Any] | None = None
    critic: dict[str, Any] | None = None  # {"token_ids", "n_tokens_injected"}: the critic_context view
    student_topk: TopLogprobs | None = None  # the policy's top-k per trained token, when its session recorded it
    # as one of a rollout's sequences (``core.branches``; None for a trajectory fetched by its response id)
    response_ids: list[str] | None = None  # root to leaf
    branch: dict[str, Any] | None = None  # where the sequence leaves the tree: kind, label, from, at_message
    main: bool | None = None
    dropped: bool | None = None  # a retry the conversation did not go on from: nothing in it is trained
    #: the rollout's other sequences (not dropped), on the main one a finish emits for a whole rollout
    branches: list[AssembledTrajectory] = field(default_factory=list)
    #: on that main one: the rollout's counts (``wire.trajectory.RolloutCounts``: sequences, sampled, trained and
    #: dropped tokens, dropped sequences), since the dropped retries are not among its branches
    rollout_counts: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "response_id": self.response_id,
            "session_id": self.session_id,
            "messages": self.messages,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "extra": self.extra,
            "total_token_ids": self.total_token_ids,
            # float32 values widened exactly, so they print as the engine reported them
            "total_loss_weight": self.total_loss_weight.astype(np.float64),
            "total_token_logprobs": self.total_token_logprobs.astype(np.float64),
            "routed_experts": encode_routed_experts(self.routed_experts),
            "turns": self.turns,
            "forks": self.forks,
            "routing_disagreements": self.routing_disagreements,
            "policy_versions": [span.to_dict() for span in self.policy_versions],
            "images": [span.to_dict() for span in self.images],
            "trace_ids": self.trace_ids,
            "teacher": self.teacher,
            "total_teacher_logprobs": self.total_teacher_logprobs,
            "teacher_topk": self.teacher_topk,
            "critic": self.critic,
            "student_topk": None
            if self.student_topk is None
            else {"ids": encode_array(self.student_topk.ids), "logprobs": encode_array(self.student_topk.logprobs)},
            "response_ids": self.response_ids,
            "branch": self.branch,
            "main": self.main,
            "dropped": self.dropped,
            "branches": [branch.to_json() for branch in self.branches],
            "rollout_counts": self.rollout_counts,
        }


def assemble(
    session_id: str,
    path: Sequence[ResponseNode],
    *,
    extra: dict[str, Any] | None = None,
    trained: frozenset[str] | None = None,
) -> AssembledTrajectory:
    """``trained``: the generated nodes whose tokens this trajectory trains (a rollout's sequence,
    ``core.branches``); the others' tokens keep their logprobs and versions with weight 0. None: all."""
    ids, weights, logprobs, messages = [], [], [], []
    forks = []
    spans = []
    images: list[ImageSpan] = []
    position = 0
    for node in path:
        ids += [node.prompt_ids, node.output_ids]
        images += [span.shifted(position) for span in node.images]
        position += len(node.prompt_ids)
        spans += [
            PolicySpan(span.version, position + span.start, position + span.end, span.policy)
            for span in node.policy_versions
        ]
        position += len(node.output_ids)
        weights.append(np.zeros(len(node.prompt_ids), dtype=np.float32))
        logprobs.append(np.zeros(len(node.prompt_ids), dtype=np.float32))
        if node.kind is NodeKind.GENERATED and (trained is None or node.id in trained):
            weights.append(np.ones(len(node.output_ids), dtype=np.float32))
            logprobs.append(node.output_logprobs)
        else:
            weights.append(np.zeros(len(node.output_ids), dtype=np.float32))
            logprobs.append(np.zeros(len(node.output_ids), dtype=np.float32))
        messages += node.messages
        if node.fork:
            forks.append({"response_id": node.id, **node.fork})
    total_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
    generated = [node for node in path if node.kind is NodeKind.GENERATED]
    completion_tokens = sum(len(node.output_ids) for node in generated)
    leaf = path[-1]
    total_weights = np.concatenate(weights) if weights else np.zeros(0, dtype=np.float32)
    assert not any(total_weights[span.start : span.end].any() for span in images), "an image token is trained"
    return AssembledTrajectory(
        response_id=leaf.id,
        session_id=session_id,
        messages=messages,
        finish_reason=leaf.finish_reason,
        usage={
            "prompt_tokens": len(total_ids) - completion_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": len(total_ids),
        },
        extra=extra or {},
        total_token_ids=total_ids.astype(np.int32, copy=False),
        total_loss_weight=total_weights,
        total_token_logprobs=np.concatenate(logprobs) if logprobs else np.zeros(0, dtype=np.float32),
        routed_experts=assemble_routing(path, len(total_ids)),
        turns=len(generated),
        forks=forks,
        routing_disagreements=sum(node.meta.get("routing_disagreements", 0) for node in path),
        policy_versions=merge_spans(spans),
        images=images,
        trace_ids=[node.meta.get("trace_id") for node in generated],
        student_topk=_student_topk(
            generated if trained is None else [node for node in generated if node.id in trained]
        ),
    )


def _student_topk(generated: Sequence[ResponseNode]) -> TopLogprobs | None:
    """The rows of every trained turn, in order (the trained tokens'); None unless every one has them."""
    present = [node.output_topk for node in generated if node.output_topk is not None]
    if not present or len(present) != len(generated) or len({row.k for row in present}) != 1:
        return None
    return TopLogprobs(
        ids=np.concatenate([row.ids for row in present]).astype(np.int32, copy=False),
        logprobs=np.concatenate([row.logprobs for row in present]).astype(np.float32, copy=False),
    )
