"""The in-process store: the embedded default, and the reference for the contract.

Everything lives in this object (no module-level state). Expired sessions are
dropped when touched, and by a timer: a heap of (expires_at, session id) is popped
while its head is due, so a tick costs the sessions that expire, never a scan of the
live ones, and memory comes back after the TTL whatever the traffic. The timer
starts with the first session (it needs a running loop) and stops in ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollout_proxy.errors import SessionFinished, SessionNotFound
from rollout_proxy.records import ResponseNode, SessionRecord, SessionStatus, TeacherScores
from rollout_proxy.state import listing
from rollout_proxy.state.listing import SessionPage, SessionSummary, Where
from rollout_proxy.state.store import (
    HeldSlot,
    Idempotency,
    ImageBound,
    ReadAhead,
    RequestBound,
    SessionLease,
    json_bytes,
    new_images,
    with_sibling,
)
from rollout_proxy.wire.images import ImageBlob

#: Seconds between expiry sweeps: how long an expired session may still hold memory.
SWEEP_EVERY = 1.0


@dataclass(slots=True)
class _SessionState:
    session: SessionRecord
    nodes: dict[str, ResponseNode] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)
    latest: dict[str, str] = field(default_factory=dict)
    idempotency: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (fingerprint, response id)
    summary: SessionSummary | None = None  # written at create and at finish (the listing's index)
    teacher: dict[str, TeacherScores] = field(default_factory=dict)  # response id -> its teacher pass
    images: dict[str, ImageBlob] = field(default_factory=dict)  # sha256 -> image, each once
    image_bytes: int = 0  # their bytes, summed
    # the root-to-leaf path last written or read (nodes never change): the next turn's path is this one, or
    # this one and one node more, so a conversation's path is not walked up node by node every turn
    held_path: list[ResponseNode] = field(default_factory=list)


@dataclass(slots=True)
class _Bound:
    """One key's request bound while anyone holds or waits for one of its slots (then it is dropped)."""

    slots: asyncio.Semaphore
    users: int = 0


@dataclass(eq=False, slots=True)
class _TakenSlot:
    """A slot a session read took (``ReadAhead.bound``): the lease's, until its write, close or task end."""

    key: str
    store: MemoryStore
    given_back: bool = False

    @property
    def held(self) -> bool:
        return not self.given_back

    async def give_back(self) -> None:
        self.let_go()

    def let_go(self) -> None:
        if not self.given_back:
            self.given_back = True
            self.store._release(self.key)


class MemoryStore:
    def __init__(
        self, *, clock=time.time, sweep_every: float = SWEEP_EVERY, image_bound: ImageBound | None = None
    ) -> None:
        self._clock = clock
        self._image_bound = image_bound or ImageBound()
        self._sweep_every = sweep_every
        self._sessions: dict[str, _SessionState] = {}
        self._expiries: list[tuple[float, str]] = []  # a heap; entries of dropped sessions go when popped
        self._sweeper: asyncio.Task[None] | None = None
        self._limits: dict[str, _Bound] = {}  # request_slot's bounds, by key, while in use
        self._fleet_state: bytes | None = None  # JSON, so a reader never shares the writer's objects

    def _state(self, session_id: str) -> _SessionState | None:
        state = self._sessions.get(session_id)
        if state is not None and state.session.expires_at <= self._clock():
            del self._sessions[session_id]
            return None
        return state

    def expire(self) -> int:
        """Drop the sessions whose time is up (only they are looked at); how many went."""
        now = self._clock()
        dropped = 0
        while self._expiries and self._expiries[0][0] <= now:
            _, session_id = heapq.heappop(self._expiries)
            state = self._sessions.get(session_id)
            if state is not None and state.session.expires_at <= now:
                del self._sessions[session_id]
                dropped += 1
        return dropped

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_every)
            self.expire()

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="memory-store-expiry")

    async def create_session(self, session: SessionRecord) -> None:
        self._start_sweeper()
        self._sessions[session.id] = _SessionState(session=session, summary=listing.opened(session))
        heapq.heappush(self._expiries, (session.expires_at, session.id))

    async def get_session(self, session_id: str) -> SessionRecord | None:
        state = self._state(session_id)
        return None if state is None else state.session

    async def lease_session(self, session_id: str, read_ahead: ReadAhead) -> SessionLease | None:
        """The read ahead is just a read (no await: as of this step of the event loop); a free slot of the
        session's bound is taken with it, as the Redis store takes it."""
        state = self._state(session_id)
        if state is None:
            return None
        session = state.session
        lease = SessionLease(session)
        if read_ahead.hashes:
            matches = [state.paths.get(path_hash) for path_hash in read_ahead.hashes]
            lease.matches = (tuple(read_ahead.hashes), matches)
        leaf = read_ahead.response_id
        if leaf is None:
            for value in lease.matches[1] if lease.matches is not None else ():
                if value is not None and "#" not in value:
                    leaf = value.split("|", 1)[0]  # the newest of the nodes with this path
        if leaf is not None:
            lease.leaf, lease.path = leaf, self._path(state, leaf)
        bound = read_ahead.bound
        if (
            bound is not None
            and session.status is SessionStatus.OPEN
            and (own := RequestBound.of(session.concurrency)) is not None
            and own.key == bound.key
        ):
            lease.slot = await self._take_now(bound)
        return lease

    async def _take_now(self, bound: RequestBound) -> HeldSlot | None:
        """A slot of ``bound`` when one is free now (no wait), held until its lease gives it back or the
        task that took it ends."""
        held = self._limits.get(bound.key)
        if held is None:
            held = self._limits[bound.key] = _Bound(asyncio.Semaphore(bound.limit))
        if held.slots.locked():
            if not held.users:
                del self._limits[bound.key]
            return None
        held.users += 1
        await held.slots.acquire()  # free (checked just above): taken at once
        slot = _TakenSlot(bound.key, self)
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: slot.let_go())
        return slot

    def _release(self, key: str) -> None:
        bound = self._limits[key]
        bound.slots.release()
        bound.users -= 1
        if not bound.users:
            del self._limits[key]

    async def finish_session(self, session_id: str, result: dict) -> SessionRecord | None:
        state = self._state(session_id)
        if state is None or state.session.status is not SessionStatus.OPEN:
            return None
        json_bytes(result, "the rollout result")  # what Redis refuses, refused here too
        state.session = dataclasses.replace(state.session, status=SessionStatus.FINISHED, result=result)
        state.summary = listing.summarize(state.session, state.nodes.values())
        return state.session

    async def put_node(
        self,
        session_id: str,
        node: ResponseNode,
        *,
        paths: Mapping[str, str],
        partial_paths: Mapping[str, str],
        latest: str | None,
        idempotency: Idempotency | None = None,
        engine: str | None = None,
        lease: SessionLease | None = None,
        images: Sequence[ImageBlob] = (),
    ) -> str:
        try:
            return self._write(session_id, node, paths, partial_paths, latest, idempotency, engine, images)
        finally:
            if lease is not None:  # the turn is done with what it read, and with its slot
                lease.written()
                await lease.close()

    def _write(
        self,
        session_id: str,
        node: ResponseNode,
        paths: Mapping[str, str],
        partial_paths: Mapping[str, str],
        latest: str | None,
        idempotency: Idempotency | None,
        engine: str | None,
        images: Sequence[ImageBlob] = (),
    ) -> str:
        """No await: the checks and the write are one step of the event loop."""
        state = self._state(session_id)
        if state is None:
            raise SessionNotFound(f"session {session_id!r} not found (unknown or expired)", param="session_id")
        if state.session.status is not SessionStatus.OPEN:
            raise SessionFinished(f"session {session_id!r} is already finished", param="session_id")
        if idempotency is not None:
            held = state.idempotency.get(idempotency.key)
            if held is not None:
                return idempotency.replay(*held)
        adding = new_images(images, state.images)
        self._image_bound.check(len(state.images), state.image_bytes, adding)
        if idempotency is not None:
            state.idempotency[idempotency.key] = (idempotency.fingerprint, node.id)
        for image in adding:
            state.images[image.sha256] = image
            state.image_bytes += len(image.data)
        state.nodes[node.id] = node
        path = state.held_path
        if node.parent_id is None:
            state.held_path = [node]
        elif path and path[-1].id == node.parent_id:
            path.append(node)  # the held list is never handed out (get_path returns copies)
        for path_hash, value in partial_paths.items():
            state.paths.setdefault(path_hash, value)
        for path_hash, value in paths.items():
            state.paths[path_hash] = with_sibling(state.paths.get(path_hash), value)
        if latest is not None:
            state.latest[latest] = state.latest["*"] = node.id
        if engine is not None:
            state.session = dataclasses.replace(state.session, engine=engine)
        return node.id

    @contextlib.asynccontextmanager
    async def request_slot(
        self, key: str, limit: int, *, lease: float, taken: HeldSlot | None = None
    ) -> AsyncIterator[None]:
        """A semaphore per key: this process is the only one using this store (no lease needed). It lives
        while a slot of its key is held or waited for, so the keys of finished jobs hold nothing."""
        if taken is not None and taken.held and taken.key == key:
            yield  # given back by its lease
            return
        bound = self._limits.get(key)
        if bound is None:
            bound = self._limits[key] = _Bound(asyncio.Semaphore(limit))
        bound.users += 1
        try:
            async with bound.slots:
                yield
        finally:
            bound.users -= 1
            if not bound.users and self._limits.get(key) is bound:
                del self._limits[key]

    async def check_images(self, session_id: str, images: Sequence[ImageBlob]) -> None:
        state = self._state(session_id)
        if state is not None:
            self._image_bound.check(len(state.images), state.image_bytes, new_images(images, state.images))

    async def get_images(self, session_id: str, hashes: Sequence[str]) -> dict[str, ImageBlob]:
        state = self._state(session_id)
        if state is None:
            return {}
        return {sha: state.images[sha] for sha in hashes if sha in state.images}

    async def set_session_engine(self, session_id: str, engine: str) -> bool:
        state = self._state(session_id)
        if state is None:
            return False
        state.session = dataclasses.replace(state.session, engine=engine)
        return True

    async def put_teacher_scores(self, session_id: str, response_id: str, scores: TeacherScores) -> bool:
        state = self._state(session_id)
        if state is None:
            return False
        state.teacher[response_id] = scores
        return True

    async def get_teacher_scores(self, session_id: str, response_id: str) -> TeacherScores | None:
        state = self._state(session_id)
        return None if state is None else state.teacher.get(response_id)

    async def get_path(self, session_id: str, node_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        state = self._state(session_id)
        return None if state is None else self._path(state, node_id)

    @staticmethod
    def _path(state: _SessionState, node_id: str) -> list[ResponseNode] | None:
        if node_id not in state.nodes:
            return None
        held = state.held_path
        if held and held[-1].id == node_id:
            return list(held)
        path = []
        current: str | None = node_id
        while current is not None:
            node = state.nodes[current]
            path.append(node)
            current = node.parent_id
        path.reverse()
        state.held_path = list(path)
        return path

    async def match_paths(self, session_id: str, hashes: Sequence[str]) -> list[str | None]:
        state = self._state(session_id)
        if state is None:
            return [None] * len(hashes)
        return [state.paths.get(path_hash) for path_hash in hashes]

    async def latest(self, session_id: str, api: str) -> str | None:
        state = self._state(session_id)
        return None if state is None else state.latest.get(api)

    async def get_nodes(self, session_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        state = self._state(session_id)
        return None if state is None else sorted(state.nodes.values(), key=lambda node: node.created_at)

    async def list_sessions(self, where: Where, *, cursor: str | None = None, limit: int = 50) -> SessionPage:
        after = listing.decode_cursor(cursor) if cursor is not None else None
        summaries = [
            state.summary
            for state in self._sessions.values()
            if state.summary is not None and (after is None or state.summary.key < after)
        ]
        summaries.sort(key=lambda summary: summary.key, reverse=True)
        scan = listing.Scan(where, limit, self._clock())
        for summary in summaries:
            if not scan.offer(summary):
                return scan.page(exhausted=False)
        return scan.page(exhausted=True)

    async def get_fleet_state(self) -> dict[str, Any] | None:
        return None if self._fleet_state is None else orjson.loads(self._fleet_state)

    async def put_fleet_state(self, state: Mapping[str, Any]) -> None:
        self._fleet_state = json_bytes(dict(state), "the fleet state")

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        self._sessions.clear()
        self._expiries.clear()
