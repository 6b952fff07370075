"""Sessions: one per rollout, created by the trainer, used by one plugin call."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from rollout_proxy.core import branches
from rollout_proxy.core.rendering import Renderers
from rollout_proxy.core.teacher import teacher_fields
from rollout_proxy.core.trajectory import AssembledTrajectory, assemble
from rollout_proxy.engines.router import EngineRouter
from rollout_proxy.errors import (
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    NotFound,
    SessionFinished,
    SessionNotFound,
    TemplateRenderError,
    UnknownPolicy,
)
from rollout_proxy.ids import new_session_id, session_of_response
from rollout_proxy.records import BASE_POLICY, GenerationConfig, SessionRecord, SessionStatus
from rollout_proxy.state.store import ReadAhead, SessionLease, StateStore
from rollout_proxy.wire.images import ImageBlob


@dataclass(frozen=True, slots=True)
class RolloutExport:
    """A session's tree as the trainer gets it (``core.branches``): every sequence, the main one first."""

    session_id: str
    retry: str
    sequences: list[AssembledTrajectory]
    sampled_tokens: int
    trained_tokens: int
    dropped_tokens: int

    @property
    def main(self) -> AssembledTrajectory | None:
        return self.sequences[0] if self.sequences and self.sequences[0].main else None

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "retry": self.retry,
            "sequences": [{"leaf": sequence.response_id, **sequence.to_json()} for sequence in self.sequences],
            "sampled_tokens": self.sampled_tokens,
            "trained_tokens": self.trained_tokens,
            "dropped_tokens": self.dropped_tokens,
        }


@dataclass(frozen=True, slots=True)
class FinishPlan:
    """A finish checked and assembled, not yet recorded: whoever answers it builds the
    answer first, so an answer that fails leaves the session open."""

    session_id: str
    result: dict[str, Any]
    trajectories: list[AssembledTrajectory]
    #: the images the trajectories' spans name (branches included), by hash, each once: the bytes a trainer
    #: needs with the tokens (empty for text)
    images: dict[str, ImageBlob] = dataclasses.field(default_factory=dict)


def named_images(trajectories: list[AssembledTrajectory]) -> list[str]:
    """The hashes the image spans of ``trajectories`` and their branches name, in order, each once."""
    found: dict[str, None] = {}
    for trajectory in trajectories:
        for sequence in (trajectory, *trajectory.branches):
            found.update((span.sha256, None) for span in sequence.images)
    return list(found)


class SessionService:
    def __init__(self, *, store: StateStore, engines: EngineRouter, ttl: float, renderers: Renderers) -> None:
        self._store = store
        self._engines = engines
        self._ttl = ttl
        self._renderers = renderers

    async def create(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        extra: dict[str, Any],
        generation: GenerationConfig,
        context: dict[str, Any],
        n_sample: int | None = None,
        concurrency: dict[str, Any] | None = None,
        client_sampling: str = "refuse",
        retry: str = "drop",
        policy: str = BASE_POLICY,
    ) -> SessionRecord:
        """Store a new session, once its engine's template renders the sample (one engine call).

        ``policy``: the policy its turns sample with (``engines.policies``); one no registry knows is a 400
        that names the policies there are, one no engine serves now a 503 that says why, and neither stores
        anything.

        What the template cannot render is refused here rather than at every turn; when no
        engine answers, the session is made anyway and its first turn says so. The session
        goes to the least-loaded healthy engine (``Fleet.pick``) and stays there while it serves.
        A session without sample messages (a harness owns the prompt) has nothing to render yet.
        """
        try:
            self._engines.check_policy(policy)
        except UnknownPolicy as exc:  # a 404 on the admin routes, a bad field here
            raise InvalidRequest(exc.message, param="policy", code=exc.code) from exc
        engine = self._engines.pick()
        try:
            if engine is not None and messages:
                await self._renderers.render(
                    engine,
                    messages,
                    tools=tools,
                    chat_template_kwargs=generation.chat_template_kwargs,
                    add_generation_prompt=True,
                )
        except TemplateRenderError as exc:
            raise TemplateRenderError(
                f"the sample cannot be rendered (with its tools and chat_template_kwargs): {exc.message}",
                param="sample.messages",
            ) from exc
        except (EngineUnavailable, EngineTimeout):
            pass
        now = time.time()
        session = SessionRecord(
            id=new_session_id(),
            messages=messages,
            tools=tools,
            extra=extra,
            generation=generation,
            context=context,
            created_at=now,
            expires_at=now + self._ttl,
            engine=engine.url if engine is not None else None,
            n_sample=n_sample,
            concurrency=concurrency,
            client_sampling=client_sampling,
            retry=retry,
            policy=policy,
        )
        await self._store.create_session(session)
        return session

    async def get(self, session_id: str) -> SessionRecord:
        session = await self._store.get_session(session_id)
        if session is None:
            raise _not_found(session_id)
        return session

    async def get_open(self, session_id: str) -> SessionRecord:
        """The session, if it still takes requests (409 once it is finished)."""
        session = await self.get(session_id)
        if session.status is not SessionStatus.OPEN:
            raise _finished(session_id)
        return session

    async def lease_open(self, session_id: str, read_ahead: ReadAhead) -> SessionLease:
        """``get_open`` for a turn: the session read with what the turn reads next, in the same round trip,
        and the request slot taken with it (``state.store.SessionLease``: the turn carries it)."""
        lease = await self._store.lease_session(session_id, read_ahead)
        if lease is None:
            raise _not_found(session_id)
        if lease.session.status is not SessionStatus.OPEN:
            await lease.close()
            raise _finished(session_id)
        return lease

    async def trajectory(self, response_id: str, *, session_id: str | None = None) -> AssembledTrajectory:
        """The trajectory ending at ``response_id``; ``session_id`` limits where to look."""
        owner = session_of_response(response_id)
        if owner is None or (session_id is not None and owner != session_id):
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        session = await self.get(owner)
        path, scores = await asyncio.gather(
            self._store.get_path(owner, response_id, routing=True),
            self._store.get_teacher_scores(owner, response_id),
        )
        if path is None:
            raise NotFound(f"response {response_id!r} not found", param="response_id")
        trajectory = assemble(owner, path, extra=_result_extra(session, response_id))
        return trajectory if scores is None else dataclasses.replace(trajectory, **teacher_fields(scores))

    async def prepare_finish(
        self,
        session_id: str,
        *,
        status: str,
        error: str | None,
        extra: dict[str, Any],
        responses: list[dict[str, Any]] | None,
        config: dict[str, Any] | None,
    ) -> FinishPlan:
        """Check a rollout result and assemble the trajectories it names; records nothing.

        Every response id must be in the session; a group session (``n_sample``) that
        succeeds must name exactly ``n_sample``. A single rollout that names none emits
        the whole rollout (``core.branches``): its main sequence, the others as its ``branches``,
        its counts (``rollout_counts``) on the main one. Named responses are trained once each too:
        a generated turn that several named paths hold (a shared prefix, the turns before an edit)
        is trained by the first one named, weighted 0 in the others; naming a response trains it (a
        retry the session's ``retry: drop`` would drop included) and a group's samples alike.
        """
        session = await self.get_open(session_id)
        if responses is None and session.n_sample is None and status == "success":
            result: dict[str, Any] = {
                "status": status,
                "error": error,
                "extra": extra,
                "responses": None,
                "config": config,
            }
            finished = dataclasses.replace(session, status=SessionStatus.FINISHED, result=result)
            whole = await self._rollout(finished)
            main = whole.main
            if main is None:
                return FinishPlan(session_id=session_id, result=result, trajectories=[])
            result["responses"] = [{"id": main.response_id, "extra": None}]
            main.branches = [sequence for sequence in whole.sequences[1:] if not sequence.dropped]
            main.rollout_counts = {
                "sequences": 1 + len(main.branches),
                "sampled_tokens": whole.sampled_tokens,
                "trained_tokens": whole.trained_tokens,
                "dropped_tokens": whole.dropped_tokens,
                "dropped_sequences": sum(1 for sequence in whole.sequences if sequence.dropped),
            }
            return await self._plan(session_id, result, [main])
        responses = responses if responses is not None else []
        ids = [response["id"] for response in responses]
        if session.n_sample is not None and status == "success" and len(ids) != session.n_sample:
            raise InvalidRequest(
                f"a group rollout must return exactly n_sample={session.n_sample} responses, got {len(ids)}",
                param="responses",
            )
        if len(set(ids)) != len(ids):
            raise InvalidRequest("the same response id is returned twice", param="responses")
        paths = []
        for index, response_id in enumerate(ids):
            path = (
                await self._store.get_path(session_id, response_id, routing=True)
                if session_of_response(response_id) == session_id
                else None
            )
            if path is None:
                raise InvalidRequest(
                    f"response {response_id!r} is not in session {session_id!r}", param=f"responses[{index}].id"
                )
            paths.append(path)
        result = {"status": status, "error": error, "extra": extra, "responses": responses, "config": config}
        finished = dataclasses.replace(session, status=SessionStatus.FINISHED, result=result)
        # every generated turn trained once: by the first named trajectory that holds it (core.branches.train_once)
        trajectories = [
            assemble(session_id, path, extra=_result_extra(finished, response_id), trained=mine)
            for response_id, path, mine in zip(ids, paths, branches.train_once(paths), strict=True)
        ]
        return await self._plan(session_id, result, trajectories)

    async def _plan(
        self, session_id: str, result: dict[str, Any], trajectories: list[AssembledTrajectory]
    ) -> FinishPlan:
        """The plan with the images its trajectories name, read from the session's store in one round trip."""
        named = named_images(trajectories)
        images = await self._store.get_images(session_id, named) if named else {}
        missing = [sha for sha in named if sha not in images]
        if missing:  # written with their nodes in one atomic write, released with the session: never expected
            raise NotFound(f"session {session_id!r} no longer holds image {missing[0]} that its trajectories name")
        return FinishPlan(session_id=session_id, result=result, trajectories=trajectories, images=images)

    async def image(self, session_id: str, sha256: str) -> ImageBlob:
        """One image of the session's store, by the sha256 of its bytes (``NotFound`` in words if it holds none)."""
        await self.get(session_id)
        found = (await self._store.get_images(session_id, [sha256])).get(sha256)
        if found is None:
            raise NotFound(f"session {session_id!r} holds no image {sha256!r}", param="sha256")
        return found

    async def commit_finish(self, plan: FinishPlan) -> SessionRecord:
        """Record a prepared finish (compare-and-set: 409 if the session finished meanwhile)."""
        finished = await self._store.finish_session(plan.session_id, plan.result)
        if finished is None:
            raise _finished(plan.session_id)
        return finished

    async def finish(
        self,
        session_id: str,
        *,
        status: str,
        error: str | None,
        extra: dict[str, Any],
        responses: list[dict[str, Any]] | None,
        config: dict[str, Any] | None,
    ) -> tuple[SessionRecord, list[AssembledTrajectory]]:
        """``prepare_finish`` then ``commit_finish``, for callers with no answer to build
        in between (an HTTP handler serializes its answer between the two)."""
        plan = await self.prepare_finish(
            session_id, status=status, error=error, extra=extra, responses=responses, config=config
        )
        return await self.commit_finish(plan), plan.trajectories

    async def rollout(self, session_id: str) -> RolloutExport:
        """Every sequence of the session's tree (``core.branches``), in one read of its nodes."""
        return await self._rollout(await self.get(session_id))

    async def _rollout(self, session: SessionRecord) -> RolloutExport:
        nodes = await self._store.get_nodes(session.id, routing=True)
        if nodes is None:
            raise _not_found(session.id)
        # a group session's siblings with one input are its samples, not retries: all of them are trained
        policy = "keep" if session.n_sample is not None else session.retry
        plan = branches.rollout(nodes, retry=policy)
        main = plan.main
        scores = (
            await self._store.get_teacher_scores(session.id, main.leaf.id) if main is not None and main.main else None
        )
        sequences = []
        for sequence in plan.sequences:
            trajectory = assemble(
                session.id, sequence.path, extra=_result_extra(session, sequence.leaf.id), trained=sequence.trained
            )
            trajectory.response_ids = [node.id for node in sequence.path]
            trajectory.branch = sequence.branch.to_json()
            trajectory.main, trajectory.dropped = sequence.main, sequence.dropped
            if sequence.main and scores is not None:  # a teacher pass is of the main sequence (the runner's)
                trajectory = dataclasses.replace(trajectory, **teacher_fields(scores))
            sequences.append(trajectory)
        return RolloutExport(
            session_id=session.id,
            retry=policy,
            sequences=sequences,
            sampled_tokens=plan.sampled_tokens,
            trained_tokens=plan.trained_tokens,
            dropped_tokens=plan.dropped_tokens,
        )

    async def latest_trajectory(self, session_id: str, api: str = "*") -> AssembledTrajectory:
        """The trajectory of the session's latest response (``api``: of that API only; ``"*"``: any)."""
        await self.get(session_id)
        response_id = await self._store.latest(session_id, api)
        if response_id is None:
            what = "response" if api == "*" else f"{api} response"
            raise NotFound(f"session {session_id!r} has no {what} yet", param="session_id")
        return await self.trajectory(response_id, session_id=session_id)


def _not_found(session_id: str) -> SessionNotFound:
    return SessionNotFound(f"session {session_id!r} not found (unknown or expired)", param="session_id")


def _finished(session_id: str) -> SessionFinished:
    return SessionFinished(f"session {session_id!r} is already finished", param="session_id")


def _result_extra(session: SessionRecord, response_id: str) -> dict[str, Any]:
    """The rollout result's ``extra`` for this response, once the session is finished."""
    result = session.result or {}
    extra = dict(result.get("extra") or {})
    for response in result.get("responses") or []:
        if response.get("id") == response_id and response.get("extra"):
            extra.update(response["extra"])
    return extra
