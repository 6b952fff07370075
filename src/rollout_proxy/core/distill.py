"""Teachers (each an engine group of its own) and the passes over a recorded trajectory.

``teacher_pass`` scores a trajectory with a named teacher (``core.teacher``) and keeps the answer in
the store with the session, so ``GET .../trajectory`` carries the teacher's fields from then on (a
later pass of the same response replaces it); ``critic_view`` renders ``critic_context`` into the
critic's token ids and stores nothing. The runner also puts both on the trajectory it grades and
publishes.
Before a teacher scores anything its tokenizer is compared with the student's on a canonical text
(once per teacher): a student's token ids mean nothing to a teacher with another vocabulary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import structlog

from rollout_proxy.core.teacher import (
    CANONICAL_TEXT,
    PromptScorer,
    TeacherScores,
    View,
    check_topk,
    render_view,
    score,
    view_spans,
)
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.engines.base import GenerationEngine, PromptImages
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.health import EngineState
from rollout_proxy.errors import EngineTimeout, EngineUnavailable, ImagesUnsupported, InvalidRequest, NotFound
from rollout_proxy.ids import session_of_response
from rollout_proxy.records import ImageSpan, ResponseNode, SessionRecord
from rollout_proxy.settings import check_engine_urls
from rollout_proxy.state.store import StateStore
from rollout_proxy.tokenization.images import ImagePlaceholders
from rollout_proxy.tokenization.local import LocalTemplate, LocalTemplateUnavailable, read_chat_template, tokenizer_dir
from rollout_proxy.tokenization.renderer import ChatRenderer

log = structlog.get_logger(__name__)
T = TypeVar("T")


def parse_teachers(spec: str) -> dict[str, tuple[str, ...]]:
    """``name=URL[,URL][;name=URL...]`` (the CLI's repeated ``--teacher`` joined by ``;``) to {name: urls}."""
    teachers: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, urls = item.partition("=")
        try:
            engines = check_engine_urls(urls.split(","))
        except ValueError as exc:
            raise ValueError(f"teacher {name.strip()!r}: {exc}") from None
        if not name.strip() or not engines:
            raise ValueError(f"a teacher is name=URL[,URL...], not {item!r}")
        if name.strip() in teachers:
            raise ValueError(f"teacher {name.strip()!r} is named twice")
        teachers[name.strip()] = engines
    return teachers


def parse_teacher_templates(spec: str, teachers: Mapping[str, object]) -> dict[str, str]:
    """``name=FILE[;name=FILE...]`` to {name: template text}: each a known teacher's, each file readable now."""
    templates: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, path = (part.strip() for part in item.partition("="))
        if not name or not path:
            raise ValueError(f"a teacher template is name=FILE, not {item!r}")
        if name not in teachers:
            raise ValueError(f"a template for teacher {name!r}, which is not a teacher (--teacher {name}=URL)")
        try:
            templates[name] = read_chat_template(path)
        except LocalTemplateUnavailable as exc:
            raise ValueError(f"teacher {name!r}: {exc}") from None
    return templates


async def _once(tasks: dict[str, asyncio.Task[T]], key: str, start: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``start()``'s result, run once per ``key`` (again after a failure) and shared by concurrent callers;
    a caller that is cancelled leaves the run going for the others."""
    task = tasks.get(key)
    if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
        task = tasks[key] = asyncio.create_task(start())
    return await asyncio.shield(task)


class Distillation:
    """The proxy's teachers and the passes that use them.

    A teacher's contexts are rendered with its ``templates`` entry when it has one (locally, with the
    student's tokenizer: ``tokenizer``, else the teacher engine's model root), else by its engine. A
    trajectory with images goes to the teacher with them, collapsed by the student's ``image_rule``."""

    def __init__(
        self,
        *,
        store: StateStore,
        student: Fleet,
        teachers: Mapping[str, Fleet],
        templates: Mapping[str, str] | None = None,
        tokenizer: str = "",
        image_rule: Callable[[GenerationEngine], Awaitable[ImagePlaceholders]] | None = None,
    ) -> None:
        self._store = store
        self._image_rule = image_rule  # the student's (``core.rendering.Renderers.image_rule``)
        self._student = student
        self._teachers = dict(teachers)
        self._templates = dict(templates or {})
        self._tokenizer = tokenizer
        self._renderers: dict[str, ChatRenderer] = {}  # per engine URL: each learns its template's shape once
        self._local: dict[str, asyncio.Task[ChatRenderer]] = {}  # per teacher with a template of its own
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
        renderer = await self._teacher_renderer(teacher, engine) if contexts else None
        view = await self._view(
            engine, session, path, trajectory.total_token_ids, contexts, "teacher_context", renderer=renderer
        )
        images = await self._view_images(session, trajectory.images, view) if trajectory.images else None
        within = fleet.settings.call_timeout  # the teacher's client leaves completions to its fleet's bound
        try:
            async with asyncio.timeout(within):
                scores = await score(
                    teacher, cast(PromptScorer, engine), view, trajectory.total_loss_weight, topk=topk, images=images
                )
        except TimeoutError:
            error = EngineTimeout(f"teacher {teacher!r} did not score the trajectory within {within:g}s")
            fleet.report_failure(engine, error)
            raise error from None
        except Exception as exc:
            fleet.report_failure(engine, exc)
            raise
        fleet.report_success(engine)
        if not await self._store.put_teacher_scores(session_id, response_id, scores):
            log.info("teacher_pass_not_kept", session_id=session_id, reason="the session expired meanwhile")
        return scores

    async def critic_view(
        self, session_id: str, response_id: str, contexts: Sequence[Mapping[str, Any]]
    ) -> tuple[View, np.ndarray]:
        """The critic's tokens (the student's template) and the student's ``total_token_ids``."""
        session, path = await self._path(session_id, response_id)
        engine = await self._route(self._student, sticky=session.engine)
        ids = assemble(session_id, path).total_token_ids
        return await self._view(engine, session, path, ids, contexts, "critic_context"), ids

    async def _view_images(self, session: SessionRecord, spans: Sequence[ImageSpan], view: View) -> PromptImages:
        """The images of a trajectory for its teacher: each span at its place in ``view``, its bytes from the
        session's image store, the marker the student's model collapses it to (the teacher shares the student's
        tokenizer: checked), so the teacher's engine expands them as the student's did (checked on its echo)."""
        if self._image_rule is None:
            raise ImagesUnsupported("this proxy has no image placeholder rule for its teachers", param="response_id")
        rule = await self._image_rule(self._student.route(session.engine))
        blobs = await self._store.get_images(session.id, list(dict.fromkeys(span.sha256 for span in spans)))
        missing = [span.sha256 for span in spans if span.sha256 not in blobs]
        if missing:
            raise NotFound(
                f"the session's image store no longer holds {len(missing)} image(s) of this trajectory "
                f"({missing[0][:16]}...)",
                param="response_id",
            )
        return PromptImages(
            rule.marker_id,
            view_spans(view, [(span.start, span.length) for span in spans]),
            tuple(blobs[span.sha256] for span in spans),
        )

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
        engine: GenerationEngine,
        session: SessionRecord,
        path: Sequence[ResponseNode],
        ids: np.ndarray,
        contexts: Sequence[Mapping[str, Any]],
        param: str,
        *,
        renderer: ChatRenderer | None = None,
    ) -> View:
        return await render_view(
            renderer or self._renderers.setdefault(engine.url, ChatRenderer(engine)),
            path,
            ids,
            contexts,
            tools=session.tools,
            chat_template_kwargs=session.generation.chat_template_kwargs,
            param=param,
        )

    async def _teacher_renderer(self, teacher: str, engine: GenerationEngine) -> ChatRenderer | None:
        """The teacher's own template, loaded once (None: its engine renders)."""
        if teacher not in self._templates:
            return None
        return await _once(self._local, teacher, lambda: self._load_template(teacher, engine))

    async def _load_template(self, teacher: str, engine: GenerationEngine) -> ChatRenderer:
        root = None if self._tokenizer else (await engine.info()).root
        directory = tokenizer_dir(self._tokenizer or root)
        if directory is None:
            raise InvalidRequest(
                f"teacher {teacher!r} has a chat template of its own, but no tokenizer is readable here to render "
                "it with (start the proxy with --tokenizer DIR: the student's, which a teacher shares)",
                param="teacher",
                code="teacher_template_unavailable",
            )
        local = await asyncio.to_thread(LocalTemplate.load, directory, self._templates[teacher])
        return ChatRenderer(local)

    @staticmethod
    async def _route(fleet: Fleet, sticky: str | None = None) -> GenerationEngine:
        engine = await fleet.route_now(sticky)
        return engine

    @staticmethod
    async def _route_teacher(fleet: Fleet) -> GenerationEngine:
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
        await _once(self._checked, name, lambda: self._compare_tokenizers(name, fleet))

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
