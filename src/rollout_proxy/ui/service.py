"""The viewer's reads, without HTTP: sessions listed, a session's tree, a trajectory's tokens.

Everything here reads; nothing writes the store. Answers are JSON-ready dicts (numpy arrays
included: the HTTP layer serializes them). Parts that depend on something outside the store
degrade on their own: without the engine a trajectory has no text pieces, without the feed
no grades; each answer says which part is missing and why, and still shows the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from rollout_proxy.core import branches
from rollout_proxy.core.branches import Branch
from rollout_proxy.core.sessions import SessionService
from rollout_proxy.engines.base import Engine
from rollout_proxy.errors import NotFound, ProxyError, SessionNotFound, StoreUnavailable
from rollout_proxy.ids import session_of_response
from rollout_proxy.records import ResponseNode
from rollout_proxy.state import listing
from rollout_proxy.state.listing import SessionSummary
from rollout_proxy.state.store import StateStore
from rollout_proxy.ui.grades import Grade, GradeBook
from rollout_proxy.ui.pieces import PieceCache, TokenDecoder


class Engines(Protocol):
    """How the viewer finds a session's engine (the engine fleet has this)."""

    def get(self, sticky: str | None) -> Engine: ...


@dataclass(frozen=True, slots=True)
class SessionFilter:
    """The listing's filters; None: any. A session matches when it passes every one given."""

    status: str | None = None
    job_id: str | None = None
    finish_reason: str | None = None  # one of its branches ended so
    forks: bool | None = None  # it has a fork (or has none)
    drift: bool | None = None  # routing disagreements or non-finite logprobs were recorded
    policy_version: str | None = None  # one of its tokens was sampled by this version ("3", "pol@v3")
    policy: str | None = None  # its turns sample with this policy ("base", or a LoRA policy's name)
    graded: bool | None = None  # the trainer feed has a reward for one of its trajectories
    min_reward: float | None = None  # one of its graded trajectories has a reward in the range
    max_reward: float | None = None

    @property
    def needs_grades(self) -> bool:
        return self.graded is not None or self.min_reward is not None or self.max_reward is not None

    def accepts(self, summary: SessionSummary, grades: dict[str, Grade]) -> bool:
        checks = (
            self.status is None or summary.status == self.status,
            self.job_id is None or summary.job_id == self.job_id,
            self.finish_reason is None or self.finish_reason in summary.finish_reasons,
            self.forks is None or (summary.forks > 0) == self.forks,
            self.drift is None or (summary.drift > 0) == self.drift,
            self.policy_version is None or self.policy_version in summary.policy_versions,
            self.policy is None or summary.policy == self.policy,
            self.graded is None or bool(grades) == self.graded,
        )
        if not all(checks):
            return False
        if self.min_reward is None and self.max_reward is None:
            return True
        low = float("-inf") if self.min_reward is None else self.min_reward
        high = float("inf") if self.max_reward is None else self.max_reward
        return any(grade.reward is not None and low <= grade.reward <= high for grade in grades.values())


def node_json(node: ResponseNode, branch: Branch | None = None) -> dict[str, Any]:
    """One node of the tree as the viewer draws it (its tokens counted, not listed), with its branch."""
    return {
        "branch": None if branch is None else branch.to_json(),
        "id": node.id,
        "parent_id": node.parent_id,
        "kind": node.kind.value,
        "api": node.api,
        "messages": node.messages,
        "n_input_messages": node.n_input_messages,
        "finish_reason": node.finish_reason,
        "prompt_tokens": len(node.prompt_ids),
        "output_tokens": len(node.output_ids),
        "usage": node.usage,
        "fork": node.fork,
        "created_at": node.created_at,
        "model": node.model,
        "meta": node.meta,
        "policy_versions": sorted(listing.node_policy_versions(node)),
    }


def segments(path: list[ResponseNode]) -> list[dict[str, Any]]:
    """Which node each stretch of the trajectory's tokens came from, and whether it was sampled."""
    found, start = [], 0
    for node in path:
        for part, ids in (("prompt", node.prompt_ids), ("output", node.output_ids)):
            if len(ids):
                found.append(
                    {"node_id": node.id, "kind": node.kind.value, "part": part, "start": start, "end": start + len(ids)}
                )
                start += len(ids)
    return found


class Viewer:
    def __init__(
        self,
        *,
        store: StateStore,
        sessions: SessionService,
        engines: Engines,
        grades: GradeBook,
        pieces: PieceCache,
    ) -> None:
        self._store = store
        self._sessions = sessions
        self._engines = engines
        self._grades = grades
        self._pieces = pieces

    def _summary_json(self, summary: SessionSummary) -> dict[str, Any]:
        grades = self._grades.of_session(summary.session_id)
        return {**summary.to_dict(), "rewards": [grade.reward for grade in grades.values()]}

    async def list_sessions(self, where: SessionFilter, *, cursor: str | None, limit: int) -> dict[str, Any]:
        """Live sessions, newest first, that pass ``where``; ``next`` pages on (see ``state.listing``)."""
        grades_error = await self._grades.refresh()
        if grades_error and where.needs_grades:
            raise StoreUnavailable(f"filtering by reward needs the trainer feed, and {grades_error}")
        page = await self._store.list_sessions(
            lambda summary: where.accepts(summary, self._grades.of_session(summary.session_id)),
            cursor=cursor,
            limit=limit,
        )
        return {
            "data": [self._summary_json(summary) for summary in page.summaries],
            "next": page.next,
            "feed": self._grades.available,
            "grades_error": grades_error,
        }

    async def session(self, session_id: str) -> dict[str, Any]:
        """The session's record, a summary of its tree as it is now, every node, and its grades."""
        record = await self._sessions.get(session_id)
        nodes = await self._store.get_nodes(session_id)
        if nodes is None:
            raise SessionNotFound(f"session {session_id!r} not found (unknown or expired)", param="session_id")
        grades_error = await self._grades.refresh()
        info = record.to_dict()
        info.pop("engine", None)  # the viewer has no use for it
        plan = branches.rollout(nodes, retry="keep" if record.n_sample is not None else record.retry)
        return {
            "session": info,
            "summary": listing.summarize(record, nodes).to_dict(),
            "nodes": [node_json(node, plan.branches.get(node.id)) for node in nodes],
            # which sequence trains which nodes (``core.branches``), as GET /v1/sessions/{id}/rollout exports it
            "sequences": [
                {
                    "leaf": sequence.leaf.id,
                    "response_ids": [node.id for node in sequence.path],
                    "branch": sequence.branch.to_json(),
                    "main": sequence.main,
                    "dropped": sequence.dropped,
                    "trained": [node.id for node in sequence.path if node.id in sequence.trained],
                }
                for sequence in plan.sequences
            ],
            "tokens": {
                "sampled": plan.sampled_tokens,
                "trained": plan.trained_tokens,
                "dropped": plan.dropped_tokens,
            },
            "grades": {
                response_id: grade.to_json() for response_id, grade in self._grades.of_session(session_id).items()
            },
            "feed": self._grades.available,
            "grades_error": grades_error,
        }

    async def _token_pieces(self, engine_url: str | None, ids: list[int]) -> tuple[list[str | None], str | None]:
        """Each token's text from the session's engine (another, if it left); why not, when it cannot."""
        try:
            engine = self._engines.get(engine_url)
            if not isinstance(engine, TokenDecoder):
                return [None] * len(ids), "the engine cannot decode token ids"
            model = (await engine.info()).model
        except ProxyError as exc:
            return [None] * len(ids), f"the engine could not decode the token pieces: {exc.message}"
        pieces = await self._pieces.pieces(engine, model, ids)
        return pieces.texts, pieces.error

    async def tokens(self, response_id: str) -> dict[str, Any]:
        """The trajectory ending at ``response_id`` as the trainer gets it, and what the viewer adds:
        each token's text piece, which node each token and message came from, its grade."""
        owner = session_of_response(response_id)
        if owner is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        trajectory = await self._sessions.trajectory(response_id)
        session = await self._sessions.get(owner)
        path = await self._store.get_path(owner, response_id)
        if path is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        ids = trajectory.total_token_ids.tolist()
        texts, pieces_error = await self._token_pieces(session.engine, ids)
        grades_error = await self._grades.refresh()
        grade = self._grades.of_response(response_id)
        token_advantages = None
        if grade is not None and grades_error is None:
            try:
                token_advantages = await self._grades.token_advantages(grade)
            except ProxyError as exc:
                grades_error = f"the trainer feed cannot be read now: {exc.message}"
        return {
            "trajectory": trajectory.to_json(),
            "pieces": texts,
            "pieces_error": pieces_error,
            "segments": segments(path),
            "message_nodes": [node.id for node in path for _ in node.messages],
            "grade": None if grade is None else grade.to_json(),
            "token_advantages": token_advantages,
            "feed": self._grades.available,
            "grades_error": grades_error,
        }
