"""Teachers (each an engine group of its own) and the passes over a recorded trajectory.

``teacher_pass`` scores a trajectory with a named teacher (``core.teacher``); ``critic_view`` renders
``critic_context`` into the critic's token ids. Both read the trajectory's path from the store and
change no stored state: the runner puts the answer on the trajectory it grades and publishes.
Before a teacher scores anything its tokenizer is compared with the student's on a canonical text
(once per teacher): a student's token ids mean nothing to a teacher with another vocabulary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import structlog

from rollout_proxy.core.teacher import CANONICAL_TEXT, PromptScorer, TeacherScores, View, check_topk, render_view, score
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.engines.base import Engine
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.health import EngineState
from rollout_proxy.errors import EngineTimeout, EngineUnavailable, InvalidRequest, NotFound
from rollout_proxy.ids import session_of_response
from rollout_proxy.records import ResponseNode, SessionRecord
from rollout_proxy.state.store import StateStore
from rollout_proxy.tokenization.renderer import ChatRenderer

log = structlog.get_logger(__name__)


def parse_teachers(spec: str) -> dict[str, tuple[str, ...]]:
    """``name=URL[,URL][;name=URL...]`` (the CLI's repeated ``--teacher`` joined by ``;``) to {name: urls}."""
    teachers: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, urls = item.partition("=")
        engines = tuple(url.strip() for url in urls.split(",") if url.strip())
        if not name.strip() or not engines:
            raise ValueError(f"a teacher is name=URL[,URL...], not {item!r}")
        if name.strip() in teachers:
            raise ValueError(f"teacher {name.strip()!r} is named twice")
        teachers[name.strip()] = engines
    return teachers


class Distillation:
    """The proxy's teachers and the passes that use them."""

    def __init__(self, *, store: StateStore, student: Fleet, teachers: Mapping[str, Fleet]) -> None:
        self._store = store
        self._student = student
        self._teachers = dict(teachers)
        self._renderers: dict[str, ChatRenderer] = {}  # per engine URL: each learns its template's shape once
        self._checked: dict[str, asyncio.Task[None]] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._teachers)

    async def teacher_pass(
        self,
        session_id: str,
        response_id: str,
        *,
        teacher: str,
        contexts: Sequence[Mapping[str, Any]] = (),
        topk: int = 0,
    ) -> TeacherScores:
        fleet = self._teachers.get(teacher)
        if fleet is None:
            known = ", ".join(self.names) or "none: start it with --teacher NAME=URL"
            raise InvalidRequest(f"unknown teacher {teacher!r} (this proxy's teachers: {known})", param="teacher")
        topk = check_topk(topk)
        session, path = await self._path(session_id, response_id)
        await self._check_tokenizer(teacher, fleet)
        engine = await self._route_teacher(fleet)
        trajectory = assemble(session_id, path)
        view = await self._view(engine, session, path, trajectory.total_token_ids, contexts, "teacher_context")
        within = fleet.settings.call_timeout  # the teacher's client leaves completions to its fleet's bound
        try:
            async with asyncio.timeout(within):
                scores = await score(teacher, cast(PromptScorer, engine), view, trajectory.total_loss_weight, topk=topk)
        except TimeoutError:
            error = EngineTimeout(f"teacher {teacher!r} did not score the trajectory within {within:g}s")
            fleet.report_failure(engine, error)
            raise error from None
        except Exception as exc:
            fleet.report_failure(engine, exc)
            raise
        fleet.report_success(engine)
        return scores

    async def critic_view(
        self, session_id: str, response_id: str, contexts: Sequence[Mapping[str, Any]]
    ) -> tuple[View, np.ndarray]:
        """The critic's tokens (the student's template) and the student's ``total_token_ids``."""
        session, path = await self._path(session_id, response_id)
        engine = await self._route(self._student, sticky=session.engine)
        ids = assemble(session_id, path).total_token_ids
        return await self._view(engine, session, path, ids, contexts, "critic_context"), ids

    async def _path(self, session_id: str, response_id: str) -> tuple[SessionRecord, list[ResponseNode]]:
        if session_of_response(response_id) != session_id:
            raise NotFound(f"response {response_id!r} not found in session {session_id!r}", param="response_id")
        session = await self._store.get_session(session_id)
        path = await self._store.get_path(session_id, response_id) if session is not None else None
        if session is None or path is None:
            raise NotFound(f"response {response_id!r} not found in session {session_id!r}", param="response_id")
        return session, list(path)

    async def _view(
        self,
        engine: Engine,
        session: SessionRecord,
        path: Sequence[ResponseNode],
        ids: np.ndarray,
        contexts: Sequence[Mapping[str, Any]],
        param: str,
    ) -> View:
        renderer = self._renderers.setdefault(engine.url, ChatRenderer(engine))
        return await render_view(
            renderer,
            path,
            ids,
            contexts,
            tools=session.tools,
            chat_template_kwargs=session.generation.chat_template_kwargs,
            param=param,
        )

    @staticmethod
    async def _route(fleet: Fleet, sticky: str | None = None) -> Engine:
        engine = await fleet.route_now(sticky)
        return engine

    @staticmethod
    async def _route_teacher(fleet: Fleet) -> Engine:
        """A healthy engine of the teacher's group; its weight version is not the policy's, so one the fleet
        calls stale (another version, or a name such as "teacher-v2") serves as well."""
        try:
            return await fleet.route_now(None)
        except EngineUnavailable:
            stale = [m for m in fleet.members.values() if m.state is EngineState.STALE and not m.draining]
            if not stale:
                raise
            return stale[0].client

    async def _check_tokenizer(self, name: str, fleet: Fleet) -> None:
        task = self._checked.get(name)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._checked[name] = asyncio.create_task(self._compare_tokenizers(name, fleet))
        await asyncio.shield(task)

    async def _compare_tokenizers(self, name: str, fleet: Fleet) -> None:
        teacher = await self._route_teacher(fleet)
        student = await self._route(self._student)
        theirs, ours = await asyncio.gather(
            teacher.tokenize_text(CANONICAL_TEXT), student.tokenize_text(CANONICAL_TEXT)
        )
        if not np.array_equal(theirs, ours):
            log.warning("teacher_tokenizer_differs", teacher=name, engine=teacher.url, student=student.url)
            raise InvalidRequest(
                f"teacher {name!r} tokenizes text differently from the student: its logprobs of the student's "
                "token ids would be meaningless (a teacher must share the student's tokenizer)",
                param="teacher",
                code="teacher_tokenizer_mismatch",
            )
