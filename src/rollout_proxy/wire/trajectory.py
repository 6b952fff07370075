"""``Trajectory``: what graders and the trainer receive, one schema for everyone.

The server assembles it from the response tree (``core.trajectory``) and answers it as
JSON of exactly these fields; the SDK hands it to graders, the runner publishes it in
feed groups, the trainer's consumer reads it back. Token arrays travel as JSON lists
(``routed_experts`` as a compact base64 array); the methods give numpy views.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from rollout_proxy.wire.arrays import decode_array
from rollout_proxy.wire.generation import BASE_POLICY
from rollout_proxy.wire.routed_experts import decode_routed_experts


class PolicyVersionSpan(BaseModel):
    """Tokens ``[start, end)`` of ``total_token_ids`` sampled by ``policy`` at ``version`` (the trainer's step: a
    LoRA policy's adapter version, the fleet's for the base). ``policy`` is absent for the base on the wire, as
    in spans from before policies, and reads as ``"base"``."""

    version: int
    start: int
    end: int
    policy: str = BASE_POLICY

    @model_serializer(mode="wrap")
    def _base_unnamed(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("policy") == BASE_POLICY:
            del data["policy"]
        return data


class TrajectoryImage(BaseModel):
    """One image of a trajectory: tokens ``[start, start + length)`` of ``total_token_ids`` are its placeholder
    span, as the engine expanded it (loss weight 0); ``sha256`` names its bytes (the session's image store),
    ``width`` x ``height`` pixels and ``bytes`` long as sent. A trainer rebuilds the model's inputs from the
    tokens and the images, in this order."""

    start: int
    length: int
    sha256: str
    width: int
    height: int
    bytes: int

    @property
    def end(self) -> int:
        return self.start + self.length


class RolloutCounts(BaseModel):
    """A whole rollout's token and sequence counts, on its main trajectory (a finish that named no responses):
    what the export counted, so that what the finish leaves out (dropped retries are not in ``branches``)
    still reaches a trainer. ``sampled_tokens == trained_tokens + dropped_tokens``."""

    #: ``len(sequences())``: the main sequence and its branches
    sequences: int
    #: every token the engine generated for the session's nodes
    sampled_tokens: int
    #: loss weight 1, over all of ``sequences()`` (each sampled token in exactly one)
    trained_tokens: int
    #: the tokens of the dropped retries (``retry: drop``), trained nowhere
    dropped_tokens: int = 0
    #: the dropped retries' sequences, left out of ``branches``
    dropped_sequences: int = 0


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="allow")

    response_id: str | None = None
    session_id: str | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    #: every token, from the sample's first message to the end
    total_token_ids: list[int] | None = None
    #: 1.0 where the policy sampled the token, 0.0 elsewhere
    total_loss_weight: list[float] | None = None
    #: the sampling logprob where the weight is 1, 0.0 elsewhere
    total_token_logprobs: list[float] | None = None
    #: MoE routing replay rows, ``{"dtype", "shape", "data"}``; None for dense models
    routed_experts: dict[str, Any] | None = None
    turns: int | None = None
    #: where the plugin rewrote history: ``{"response_id", "diverged_from", "at_message"}``
    forks: list[dict[str, Any]] = Field(default_factory=list)
    routing_disagreements: int = 0
    #: which policy version sampled which generated tokens (prompt, bridge and injected tokens: none)
    policy_versions: list[PolicyVersionSpan] = Field(default_factory=list)
    #: where each image's placeholder span is among ``total_token_ids``, in order (empty: a text-only trajectory)
    images: list[TrajectoryImage] = Field(default_factory=list)
    #: the trace id (32 hex digits) of each generated turn's request, in order; None where it had none
    trace_ids: list[str | None] = Field(default_factory=list)
    #: on-policy distillation: the teacher that scored this trajectory (``config["teachers"]``), else None
    teacher: str | None = None
    #: the teacher's logprob of each token, aligned with ``total_token_ids``: a value where the weight is > 0
    total_teacher_logprobs: list[float | None] | None = None
    #: the teacher's top-k per trained token: ``{"ids", "logprobs"}``, each a ``{dtype, shape, data}`` array
    #: of shape (trained tokens, k) (int32, float32), in the order of the trained tokens
    teacher_topk: dict[str, Any] | None = None
    #: the policy's own top-k at sampling time per trained token (a session with ``top_logprobs``, OPD
    #: ``topk_type: student``): ``{"ids", "logprobs"}`` as ``teacher_topk``, rows in the same order
    student_topk: dict[str, Any] | None = None
    #: the critic's view (``critic_context`` inserted): ``{"token_ids", "n_tokens_injected"}``
    critic: dict[str, Any] | None = None
    #: as one sequence of a rollout (a session's tree: subagents, compactions, retries; the server's
    #: ``core.branches``): its nodes root to leaf, where it leaves the tree (``kind``: continuation, rewrite,
    #: new_conversation or retry; the client's ``label``; ``from``; ``at_message``), whether it is the
    #: rollout's main sequence, whether it was dropped (a retry the conversation did not go on from)
    response_ids: list[str] | None = None
    branch: dict[str, Any] | None = None
    main: bool | None = None
    dropped: bool | None = None
    #: the rollout's other sequences, on the main one (a finish that named no responses): every sampled token
    #: of the rollout has loss weight 1 in exactly one of ``[self, *branches]``
    branches: list[Trajectory] = Field(default_factory=list)
    #: on the main trajectory of a whole rollout: its counts, the dropped retries' among them; None elsewhere
    rollout_counts: RolloutCounts | None = None

    def sequences(self) -> list[Trajectory]:
        """This trajectory and its branches: what a trainer trains for one rollout, each token once."""
        return [self, *self.branches]

    def token_ids(self) -> np.ndarray:
        return np.asarray(self.total_token_ids or [], dtype=np.int32)

    def loss_weight(self) -> np.ndarray:
        return np.asarray(self.total_loss_weight or [], dtype=np.float32)

    def token_logprobs(self) -> np.ndarray:
        return np.asarray(self.total_token_logprobs or [], dtype=np.float32)

    def image_token_mask(self) -> np.ndarray:
        """True on the tokens of an image's placeholder span (bool, aligned with ``total_token_ids``)."""
        mask = np.zeros(len(self.total_token_ids or []), dtype=bool)
        for image in self.images:
            mask[image.start : image.end] = True
        return mask

    def routed_experts_array(self) -> np.ndarray | None:
        return decode_routed_experts(self.routed_experts)

    def teacher_logprobs(self) -> np.ndarray | None:
        """float32, NaN where the teacher gave no value (untrained tokens); None without a teacher pass."""
        if self.total_teacher_logprobs is None:
            return None
        return np.asarray([np.nan if v is None else v for v in self.total_teacher_logprobs], dtype=np.float32)

    def teacher_topk_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids int32, logprobs float32), each (trained tokens, k); None without top-k."""
        return _topk_arrays(self.teacher_topk, "teacher_topk")

    def student_topk_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids int32, logprobs float32), each (trained tokens, k); None when the session recorded none."""
        return _topk_arrays(self.student_topk, "student_topk")

    @property
    def assistant_turns(self) -> int:
        return sum(1 for message in self.messages if message.get("role") == "assistant")


def _topk_arrays(field: dict[str, Any] | None, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    if field is None:
        return None
    return decode_array(field["ids"], param=f"{name}.ids"), decode_array(field["logprobs"], param=f"{name}.logprobs")
