"""Listing sessions: one small summary per session, kept by the store beside the session.

A summary is written twice: when the session is created (who and when) and when it is
finished (what its tree holds: turns, finish reasons, forks, drift, policy versions).
Nothing on a turn's path touches it, so an open session's summary says only what was
known at create; its tree (``StateStore.get_nodes``) is always live.

Listings are newest first, paged by an opaque cursor (the last summary's creation time
and id), and filtered by a predicate the caller gives: the store scans, the caller says
what matches. A scan stops after ``SCAN_LIMIT`` summaries, so a filter that matches
rarely answers a short page with a cursor to go on from, never a slow request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rollout_proxy.errors import BadCursor
from rollout_proxy.records import BASE_POLICY, NodeKind, ResponseNode, SessionRecord, SessionStatus

#: The most summaries one listing call looks at, whatever its filter.
SCAN_LIMIT = 2000
#: How much of a failed rollout's error a summary keeps.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """What a listing shows and filters on (JSON-ready; the Redis index stores it as JSON)."""

    session_id: str
    created_at: float
    expires_at: float
    status: str = SessionStatus.OPEN.value
    job_id: str | None = None  # the runner's ``context.model_customization_job_id``
    step: int | None = None  # ``context.current_training_step``
    n_sample: int | None = None
    result_status: str | None = None  # the rollout's own status: success, failure, discard, retry
    error: str | None = None
    responses: list[str] = field(default_factory=list)  # response ids the finish emitted
    nodes: int = 0
    turns: int = 0  # generated nodes
    injected: int = 0  # nodes of messages the policy did not generate
    tokens: int = 0  # tokens the tree holds (each node's own)
    generated_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)  # of the generated leaves
    forks: int = 0
    routing_disagreements: int = 0
    nonfinite_logprobs: int = 0
    #: the versions that sampled its tokens: ``"3"`` for the base's, ``"pol@v3"`` for LoRA policy pol's
    policy_versions: list[str] = field(default_factory=list)
    #: the policy its turns sample with (``SessionRecord.policy``)
    policy: str = BASE_POLICY

    @property
    def key(self) -> tuple[float, str]:
        """The listing order (newest first is descending)."""
        return (self.created_at, self.session_id)

    @property
    def drift(self) -> int:
        """What the proxy recorded but could not avoid: re-sent routing rows that disagreed,
        logprobs the engine sent as NaN/inf."""
        return self.routing_disagreements + self.nonfinite_logprobs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionSummary:
        """From its JSON; fields it does not know (written by a newer proxy) are left out."""
        if data.keys() <= _SUMMARY_FIELDS:
            return cls(**data)
        return cls(**{name: value for name, value in data.items() if name in _SUMMARY_FIELDS})


_SUMMARY_FIELDS = frozenset(spec.name for spec in dataclasses.fields(SessionSummary))


@dataclass(frozen=True, slots=True)
class SessionPage:
    summaries: list[SessionSummary]
    next: str | None  # the cursor of the next page; None: nothing older is left


Where = Callable[[SessionSummary], bool]


def everything(summary: SessionSummary) -> bool:
    return True


def encode_cursor(key: tuple[float, str]) -> str:
    created_at, session_id = key
    return f"{created_at!r}~{session_id}"


def decode_cursor(cursor: str) -> tuple[float, str]:
    created_at, sep, session_id = cursor.partition("~")
    try:
        value = float(created_at)
    except ValueError:
        value = float("nan")
    if not sep or not session_id or value != value or value in (float("inf"), float("-inf")):
        raise BadCursor(f"{cursor!r} is not a cursor of this listing", param="cursor")
    return value, session_id


def _context_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def node_policy_versions(node: ResponseNode) -> set[str]:
    """The policy versions that sampled a node's tokens: its ``policy_versions`` spans
    (``{version, start, end, policy?}``, as objects or dicts), else a ``policy_version`` in its meta. The base's
    as the number alone (``"3"``), a LoRA policy's as its served name (``"pol@v3"``)."""
    found: set[str] = set()
    for span in getattr(node, "policy_versions", None) or node.meta.get("policy_versions") or ():
        version = span.get("version") if isinstance(span, dict) else getattr(span, "version", None)
        policy = span.get("policy") if isinstance(span, dict) else getattr(span, "policy", None)
        if version is not None:
            found.add(str(version) if policy in (None, BASE_POLICY) else f"{policy}@v{version}")
    single = node.meta.get("policy_version")
    if single is not None:
        found.add(str(single))
    return found


def opened(session: SessionRecord) -> SessionSummary:
    """A new session's summary: who opened it and when."""
    context = session.context or {}
    job = context.get("model_customization_job_id")
    return SessionSummary(
        session_id=session.id,
        created_at=session.created_at,
        expires_at=session.expires_at,
        status=session.status.value,
        job_id=job if isinstance(job, str) and job else None,
        step=_context_int(context.get("current_training_step")),
        n_sample=session.n_sample,
        policy=session.policy,
    )


def _branch_ends(nodes: list[ResponseNode]) -> list[str | None]:
    """The finish reason of each branch: its last generated node's (injected messages after it do not count)."""
    by_id = {node.id: node for node in nodes}
    parents = {node.parent_id for node in nodes}
    ends = []
    for leaf in (node for node in nodes if node.id not in parents):
        current: ResponseNode | None = leaf
        while current is not None and current.kind is not NodeKind.GENERATED:
            current = by_id.get(current.parent_id) if current.parent_id else None
        if current is not None:
            ends.append(current.finish_reason)
    return ends


def summarize(session: SessionRecord, nodes: Iterable[ResponseNode]) -> SessionSummary:
    """A session's summary from its record and every node of its tree."""
    nodes = list(nodes)
    generated = [node for node in nodes if node.kind is NodeKind.GENERATED]
    versions: set[str] = set()
    for node in generated:
        versions |= node_policy_versions(node)
    result = session.result or {}
    error = result.get("error")
    responses = [
        response["id"]
        for response in result.get("responses") or []
        if isinstance(response, dict) and isinstance(response.get("id"), str)
    ]
    return dataclasses.replace(
        opened(session),
        result_status=result.get("status") if isinstance(result.get("status"), str) else None,
        error=error[:MAX_ERROR_CHARS] if isinstance(error, str) and error else None,
        responses=responses,
        nodes=len(nodes),
        turns=len(generated),
        injected=len(nodes) - len(generated),
        tokens=sum(len(node.prompt_ids) + len(node.output_ids) for node in nodes),
        generated_tokens=sum(len(node.output_ids) for node in generated),
        finish_reasons=sorted({reason for reason in _branch_ends(nodes) if reason}),
        forks=sum(1 for node in nodes if node.fork),
        routing_disagreements=sum(int(node.meta.get("routing_disagreements", 0)) for node in nodes),
        nonfinite_logprobs=sum(int(node.meta.get("nonfinite_logprobs", 0)) for node in nodes),
        policy_versions=sorted(versions),
    )


@dataclass(slots=True)
class Scan:
    """One listing call's walk over summaries, newest first: what matched, where it stopped."""

    where: Where
    limit: int
    now: float
    found: list[SessionSummary] = field(default_factory=list)
    scanned: int = 0
    last: tuple[float, str] | None = None

    def offer(self, summary: SessionSummary) -> bool:
        """Look at the next summary; False once the page is full or the scan has gone far enough."""
        self.scanned += 1
        self.last = summary.key
        if summary.expires_at > self.now and self.where(summary):
            self.found.append(summary)
        return len(self.found) < self.limit and self.scanned < SCAN_LIMIT

    def page(self, *, exhausted: bool) -> SessionPage:
        more = not exhausted and self.last is not None
        return SessionPage(self.found, encode_cursor(self.last) if more and self.last else None)
