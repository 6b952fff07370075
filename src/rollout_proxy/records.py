"""The records the core and the stores share: sessions and response-tree nodes.

Plain dataclasses and numpy arrays (no HTTP, no Redis, no pydantic); a leaf module that
``core`` and ``state`` both import, so neither imports the other's internals.

A session is one rollout: the sample it started from, the generation settings it
pins, and a tree of ``ResponseNode``s. Each node is one model call (or one batch of
messages injected from outside the policy) and stores only what it adds to its
parent: a trajectory is the concatenation of the nodes on its root-to-leaf path.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_proxy.routing.rows import RoutingRows, RoutingSpan
from rollout_proxy.wire.generation import BASE_POLICY as BASE_POLICY  # the core's, the engines', the stores'

EMPTY_IDS = np.zeros(0, dtype=np.int32)
EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """Sampling settings pinned by the session; plugins cannot override them."""

    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled, as in the seed's GenerationConfig
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: k > 0: the policy's top-k (ids, logprobs) at each sampled token is recorded (OPD ``topk_type: student``)
    top_logprobs: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "chat_template_kwargs": self.chat_template_kwargs,
            "top_logprobs": self.top_logprobs,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationConfig:
        return cls(**data)


class SessionStatus(str, enum.Enum):
    OPEN = "open"
    FINISHED = "finished"


@dataclass(slots=True)
class SessionRecord:
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    extra: dict[str, Any]
    generation: GenerationConfig
    context: dict[str, Any]
    created_at: float
    expires_at: float
    engine: str | None = None  # sticky engine (its base URL)
    n_sample: int | None = None  # set for group rollouts
    status: SessionStatus = SessionStatus.OPEN
    result: dict[str, Any] | None = None
    concurrency: dict[str, Any] | None = None  # {"key", "max_requests"}: model calls in flight per key
    #: what a request's own generation parameters meet: "refuse" (a 400 unless a no-op) or "ignore" (the
    #: session's are used, the client's recorded on the node); ``proxy.client_sampling``
    client_sampling: str = "refuse"
    #: which of the nodes retrying one input a rollout trains (``core.branches``): "drop" all but those the
    #: conversation went on from, or "keep" them all
    retry: str = "drop"
    #: the policy every turn samples with (``engines.policies``): the base model or a LoRA policy's name
    policy: str = BASE_POLICY

    def to_dict(self) -> dict[str, Any]:
        data = {
            "id": self.id,
            "messages": self.messages,
            "tools": self.tools,
            "extra": self.extra,
            "generation": self.generation.to_dict(),
            "context": self.context,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "engine": self.engine,
            "n_sample": self.n_sample,
            "status": self.status.value,
            "result": self.result,
            "concurrency": self.concurrency,
            "client_sampling": self.client_sampling,
            "retry": self.retry,
        }
        if self.policy != BASE_POLICY:  # absent: the base (a base session's record is as before policies)
            data["policy"] = self.policy
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionRecord:
        data = dict(data)
        data["generation"] = GenerationConfig.from_dict(data["generation"])
        data["status"] = SessionStatus(data["status"])
        return cls(**data)


@dataclass(frozen=True, slots=True)
class PolicySpan:
    """Tokens ``[start, end)`` sampled by ``policy`` at ``version`` (the trainer's integer step; a LoRA
    policy's adapter version, or the fleet's version for the base).

    Positions count in a node's ``output_ids``, or in a trajectory's ``total_token_ids``.
    """

    version: int
    start: int
    end: int
    policy: str = BASE_POLICY

    def to_dict(self) -> dict[str, Any]:
        """``policy`` only when it is not the base (absent means the base, as in spans from before policies)."""
        data: dict[str, Any] = {"version": self.version, "start": self.start, "end": self.end}
        if self.policy != BASE_POLICY:
            data["policy"] = self.policy
        return data


def merge_spans(spans: Iterable[PolicySpan]) -> list[PolicySpan]:
    """Spans in order, empty ones dropped, a span that continues the previous one's policy and version merged
    into it."""
    merged: list[PolicySpan] = []
    for span in spans:
        if span.end <= span.start:
            continue
        last = merged[-1] if merged else None
        if last is not None and (last.policy, last.version, last.end) == (span.policy, span.version, span.start):
            merged[-1] = PolicySpan(span.version, last.start, span.end, span.policy)
        else:
            merged.append(span)
    return merged


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """The policy's top-k at each sampled token, best first: ``ids`` int32 and ``logprobs`` float32, (n, k)."""

    ids: np.ndarray
    logprobs: np.ndarray

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(slots=True)
class TeacherScores:
    """A teacher pass over one trajectory (on-policy distillation), aligned with its ``total_token_ids``.

    ``logprobs`` is NaN where the student did not train; ``topk`` has one row per trained token."""

    teacher: str
    logprobs: np.ndarray  # (T,) float32
    topk: TopLogprobs | None
    n_tokens_injected: int


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where one image is among tokens: ``[start, start + length)`` is the model's placeholder span for the
    image named by ``sha256`` (the sha256 of its bytes, as the session's image store keeps them), of
    ``width`` x ``height`` pixels and ``nbytes`` bytes as sent.

    Positions count in a node's ``prompt_ids``, or in a trajectory's ``total_token_ids``."""

    start: int
    length: int
    sha256: str
    width: int
    height: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def shifted(self, offset: int) -> ImageSpan:
        return ImageSpan(self.start + offset, self.length, self.sha256, self.width, self.height, self.nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "length": self.length,
            "sha256": self.sha256,
            "width": self.width,
            "height": self.height,
            "bytes": self.nbytes,
        }


class NodeKind(str, enum.Enum):
    GENERATED = "generated"  # a model call: output tokens carry loss weight 1
    INJECTED = "injected"  # messages the policy did not generate: weight 0


@dataclass(slots=True)
class ResponseNode:
    """One node of a session's response tree; it stores only what it adds.

    ``prompt_ids`` are the tokens added before generation (bridge tokens for the new
    messages and the generation prompt); ``output_ids`` / ``output_logprobs`` are what
    the engine sampled. For an injected node ``prompt_ids`` holds the rendered
    messages and the outputs are empty.
    """

    id: str
    parent_id: str | None
    kind: NodeKind
    api: str  # "chat" | "responses" | "messages" (Anthropic's) | "injected" (POST /v1/sessions/{id}/messages)
    messages: list[dict[str, Any]]  # messages this node adds (inputs, then the output)
    n_input_messages: int  # how many of ``messages`` were inputs
    prompt_ids: np.ndarray = field(default_factory=lambda: EMPTY_IDS)
    output_ids: np.ndarray = field(default_factory=lambda: EMPTY_IDS)
    output_logprobs: np.ndarray = field(default_factory=lambda: EMPTY_LOGPROBS)
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    path_hash: str = ""
    created_at: float = 0.0
    model: str | None = None
    fork: dict[str, Any] | None = None  # provenance when the request rewrote history
    meta: dict[str, Any] = field(default_factory=dict)  # api-specific extras (e.g. Responses fields)
    routing_span: RoutingSpan | None = None  # where this node's MoE routing rows are
    routing: RoutingRows | None = None  # the rows themselves, when loaded
    #: which policy version sampled which of ``output_ids`` (generated nodes; empty for injected ones)
    policy_versions: tuple[PolicySpan, ...] = ()
    #: the policy's top-k at each of ``output_ids`` when the session records it (``GenerationConfig.top_logprobs``)
    output_topk: TopLogprobs | None = None
    #: the images among ``prompt_ids``, in order: each one's placeholder span (``tokenization.images``)
    images: tuple[ImageSpan, ...] = ()
    #: the token ids of the whole root-to-here path, kept on the latest node of a conversation so the next
    #: turn's prompt is not concatenated from every node again (``core.turns.path_tokens``); not stored
    path_ids: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: the images of the whole root-to-here path, each span at its place in ``path_ids``, once asked
    #: (``core.turns.path_image_spans``); not stored
    path_images: tuple[ImageSpan, ...] | None = field(default=None, compare=False, repr=False)

    def with_routing(self, rows: RoutingRows | None) -> ResponseNode:
        self.routing, self.routing_span = rows, None if rows is None else rows.span
        return self
