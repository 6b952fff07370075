"""The state store interface, with two implementations side by side:
``memory.MemoryStore`` (in-process, the embedded default) and ``redis.RedisStore``.

Contract (tested once, over both, in tests/state/test_store_contract.py):
- a session and all its nodes expire together at ``session.expires_at``, and their
  memory is given back soon after (the memory store: within ``memory.SWEEP_EVERY``), whether
  or not anything touches the session again;
- ``put_node`` is atomic: the node, its parent link, its path-index entries, the
  "latest" pointer and its idempotency key appear together or not at all, and only
  while the session is open: a write that loses the race with ``finish_session``
  raises ``SessionFinished`` and leaves nothing behind (a finished result never
  gains nodes after it was recorded);
- an idempotency key names one node per session: a second write with the same key and
  fingerprint stores nothing and answers the first node's id; another fingerprint
  raises ``IdempotencyKeyReused``; keys expire with their session;
- ``finish_session`` is a compare-and-set from open to finished; a result that cannot
  be encoded as JSON raises ``InvalidRequest`` and changes nothing;
- ``get_path`` returns root-to-leaf nodes in one round trip, whatever the depth
  (routing rows too, when asked);
- ``match_paths`` answers for many path hashes in one round trip; a whole-node entry (``paths``) written
  where another node's path already ends keeps both, newest first: ``"<id>|<older id>..."``, at most
  ``SIBLINGS`` ids (nodes whose messages are equal by content: a group's samples that reach the same
  visible answer, told apart by ``core.tree``);
- ids are looked up within the given session only: another session's id is absent;
- a write to a session that is unknown or expired raises ``SessionNotFound``;
- ``get_nodes`` returns every node of a session in one round trip;
- ``lease_session`` reads a session for a turn with what the turn reads next (``ReadAhead``; the Redis
  store: in the same round trip) and answers with a ``SessionLease``: the record, those reads' answers
  (each used once, as of the read; dropped at the lease's node write) and the request slot taken with
  the read, if any;
- ``request_slot`` bounds the requests in flight per key across everything sharing the store; a
  slot taken with a session read (``ReadAhead.bound``) is the lease's: its turn's ``request_slot`` uses
  it, and it is given back at the lease's node write (``put_node(lease=...)``), when the lease is
  closed, or when the task that read it ends, whichever comes first; nothing is left behind;
- ``list_sessions`` pages the live sessions' summaries newest first (``state.listing``):
  a summary is written at create and at finish only, and goes when its session expires;
- ``put_fleet_state``/``get_fleet_state`` keep one JSON object, the engine fleet's shared state
  (``engines.shared``), for every worker and proxy sharing the store; it never expires;
- images (``wire.images.ImageBlob``) are kept per session by the sha256 of their bytes, each once: ``put_node``
  writes the images its node's messages need with it (put-if-absent, in the same atomic write), within the
  store's ``ImageBound`` (distinct images and their bytes per session): a write past it raises
  ``TooManyImages`` and leaves nothing behind; ``check_images`` says so ahead (as of its read);
  ``get_images`` reads many in one round trip; they expire with their session, as its nodes do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Protocol

import orjson

from rollout_proxy.errors import IdempotencyKeyReused, InvalidRequest, TooManyImages
from rollout_proxy.records import ResponseNode, SessionRecord, TeacherScores
from rollout_proxy.settings import from_setting
from rollout_proxy.state.listing import SessionPage, Where
from rollout_proxy.wire.images import ImageBlob


@dataclass(frozen=True, slots=True)
class Idempotency:
    """A client's idempotency key for one write, with a fingerprint of the request it came
    with: the same key may only ever stand for the same request."""

    key: str
    fingerprint: str

    def replay(self, fingerprint: str, response_id: str) -> str:
        """The answer to a repeated key, given what the store holds for it."""
        if fingerprint != self.fingerprint:
            raise IdempotencyKeyReused(
                f"idempotency key {self.key!r} was already used with another request", param="Idempotency-Key"
            )
        return response_id


#: How many nodes one whole-node path-index entry names at most (newest first; the oldest beyond go).
SIBLINGS = 64


def with_sibling(held: str | None, node_id: str) -> str:
    """The whole-node path-index entry after ``node_id`` is written where ``held`` was (the Redis store's
    script does the same): a whole-node entry keeps its nodes behind the new one, a partial one goes."""
    if held is None or "#" in held:
        return node_id
    return "|".join([node_id, *(other for other in held.split("|") if other != node_id)][:SIBLINGS])


#: Seconds after which a request slot whose holder died (never gave it back) is free again; a live
#: holder's lease is renewed while it holds the slot.
REQUEST_LEASE_S = 30.0


@dataclass(frozen=True, slots=True)
class RequestBound:
    """A bound on requests in flight shared by every session naming ``key`` (a job's request_concurrency)."""

    key: str
    limit: int

    @classmethod
    def of(cls, concurrency: Mapping[str, Any] | None) -> RequestBound | None:
        """A session's ``concurrency`` (``{"key", "max_requests"}``) as a bound; None for none."""
        if not concurrency:
            return None
        return cls(str(concurrency["key"]), int(concurrency["max_requests"]))


@dataclass(frozen=True, slots=True)
class ReadAhead:
    """What a turn reads right after its session, named up front so a store can read it in the same
    round trip: the path-index entries of ``hashes`` (``match_paths``) and the path of their deepest
    whole-node match, or the path of ``response_id`` (``get_path``). The read's ``SessionLease`` answers
    them (``take_matches``, ``take_path``).

    ``bound``: the request bound whose slot the turn will take (its session token names it). A store
    takes the slot with the read when one is free, for an open session of that bound only: it is then
    the lease's (``SessionLease.slot``)."""

    hashes: tuple[str, ...] = ()
    response_id: str | None = None
    bound: RequestBound | None = None


class HeldSlot(Protocol):
    """A request slot a session read took for its turn (``ReadAhead.bound``)."""

    @property
    def key(self) -> str:
        """The bound's key (``RequestBound.key``)."""
        ...

    @property
    def held(self) -> bool:
        """Not given back yet."""
        ...

    async def give_back(self) -> None:
        """Give it back now, unless it was already (then nothing happens)."""
        ...


class _NotRead(Enum):
    NOT_READ = "not read ahead"


#: what a lease answers for a read it did not make ahead (the turn reads it from the store)
NOT_READ = _NotRead.NOT_READ


@dataclass(eq=False, slots=True)
class SessionLease:
    """A session read for one turn (``StateStore.lease_session``), carried by the turn: no hidden state.

    ``matches``: the path-index entries of the ``ReadAhead``'s hashes, as of the read; ``leaf`` and ``path``:
    the node whose path was read with it (the ``ReadAhead``'s response id, or the deepest whole-node match,
    the newest of its siblings) and that path (None: not in the session). Each is answered once (a later
    read of the same is a fresh one) and both are dropped at the lease's node write. ``slot``: the request
    slot taken with the read, given back by the lease's node write, by ``close``, or when the task that
    read it ends."""

    session: SessionRecord
    matches: tuple[tuple[str, ...], list[str | None]] | None = None
    leaf: str | None = None
    path: list[ResponseNode] | None = None
    slot: HeldSlot | None = None

    def take_matches(self, hashes: Sequence[str]) -> list[str | None] | Literal[_NotRead.NOT_READ]:
        """The entries read ahead when they are those of ``hashes``; the first ask uses them up either way."""
        ahead, self.matches = self.matches, None
        if ahead is None or ahead[0] != tuple(hashes):
            return NOT_READ
        return ahead[1]

    def take_path(self, node_id: str) -> list[ResponseNode] | Literal[_NotRead.NOT_READ] | None:
        """The path read ahead when it is ``node_id``'s (None: not in the session); once, and then nothing
        read ahead is left."""
        if self.leaf is None or self.leaf != node_id:
            return NOT_READ
        path = self.path
        self.written()
        return path

    def written(self) -> None:
        """The turn wrote: what was read ahead may be stale now."""
        self.matches, self.leaf, self.path = None, None, None

    async def close(self) -> None:
        """Give back the slot no node write gave back (a turn refused or failed before it wrote)."""
        if self.slot is not None:
            await self.slot.give_back()

    async def __aenter__(self) -> SessionLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


@dataclass(frozen=True, slots=True)
class ImageBound:
    """What one session may store of images: distinct images (each once, by content), and their bytes."""

    count: int = from_setting("max_images_per_session")
    bytes: int = from_setting("max_image_session_bytes")

    def check(self, held: int, held_bytes: int, adding: Sequence[ImageBlob]) -> None:
        """``TooManyImages`` when ``adding`` (not held yet, distinct) would take a session holding ``held``
        images of ``held_bytes`` past the bound."""
        added = sum(len(image.data) for image in adding)
        if adding and (held + len(adding) > self.count or held_bytes + added > self.bytes):
            raise self.refusal(held, held_bytes, len(adding), added)

    def refusal(self, held: int, held_bytes: int, adding: int, added: int) -> TooManyImages:
        return TooManyImages(
            f"this turn would store {adding} new image(s) of {added} bytes in a session holding {held} image(s) of "
            f"{held_bytes} bytes: past what a session may store ({self.count} images, {self.bytes} bytes; "
            "--max-images-per-session, --max-image-session-bytes)",
        )


def new_images(images: Sequence[ImageBlob], held: Any) -> list[ImageBlob]:
    """``images`` not in ``held`` (a container of hashes), each once."""
    found: dict[str, ImageBlob] = {}
    for image in images:
        if image.sha256 not in held and image.sha256 not in found:
            found[image.sha256] = image
    return list(found.values())


def json_bytes(value: Any, what: str) -> bytes:
    """``value`` as JSON, or ``InvalidRequest``: a store never commits what it could not read back."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest(f"{what} cannot be stored: {exc}") from None


class StateStore(Protocol):
    async def create_session(self, session: SessionRecord) -> None: ...

    async def get_session(self, session_id: str) -> SessionRecord | None:
        """The record (with the engine the session moved to)."""
        ...

    async def lease_session(self, session_id: str, read_ahead: ReadAhead) -> SessionLease | None:
        """The record read for a turn, with what ``read_ahead`` names (``SessionLease``); None if it is gone
        (a slot taken with it is given back then, and when the session is not open or not of that bound)."""
        ...

    async def finish_session(self, session_id: str, result: dict) -> SessionRecord | None:
        """Atomically mark an open session finished with ``result``; None if it is not open."""
        ...

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
        """Store a node (and, with ``engine``, move the session there, as ``set_session_engine``; with
        ``images``, those of them the session does not hold yet, within the store's ``ImageBound``); returns the
        id stored for this write: ``node.id``, or, for an idempotency key already used with the same request,
        the earlier node's (and nothing is written). ``lease``: the turn's; its slot goes back with the write
        (the Redis store: in its round trip) and its read-ahead is dropped, whether or not the write succeeds. ``paths`` entries overwrite a partial entry and keep a whole-node one's
        nodes behind theirs (``with_sibling``), ``partial_paths`` never overwrite; the
        latest pointer is set for ``latest`` (an api name) and for ``"*"``.

        Raises ``SessionNotFound`` when the session is unknown or expired,
        ``SessionFinished`` when it is finished, ``IdempotencyKeyReused`` when the key
        came with another request, ``TooManyImages`` past the image bound (nothing written)."""
        ...

    async def check_images(self, session_id: str, images: Sequence[ImageBlob]) -> None:
        """``TooManyImages`` when storing ``images`` now would take the session past the store's ``ImageBound``
        (as of this read: ``put_node`` checks again as it writes), in one round trip; nothing for a session that
        is gone (its write says so)."""
        ...

    async def get_images(self, session_id: str, hashes: Sequence[str]) -> dict[str, ImageBlob]:
        """The session's images of ``hashes`` (those it holds), by hash, in one round trip."""
        ...

    async def get_path(self, session_id: str, node_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        """Root-to-leaf nodes ending at ``node_id``; None if it is not in the session.

        MoE routing rows are loaded only when ``routing`` is set (spans always are)."""
        ...

    async def set_session_engine(self, session_id: str, engine: str) -> bool:
        """Move the session to ``engine`` (its later turns go there), in one round trip; False if it is gone.

        A routing hint, not history: it expires with the session and never changes a node."""
        ...

    async def match_paths(self, session_id: str, hashes: Sequence[str]) -> list[str | None]: ...

    async def latest(self, session_id: str, api: str) -> str | None: ...

    async def get_nodes(self, session_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        """Every node of the session's tree, oldest first (MoE routing rows only when ``routing``), in one
        round trip; None if the session is gone."""
        ...

    async def list_sessions(self, where: Where, *, cursor: str | None = None, limit: int = 50) -> SessionPage:
        """Summaries of live sessions that ``where`` accepts, newest first, after ``cursor``.

        A page may hold fewer than ``limit`` while ``next`` is set: the scan stops after
        ``listing.SCAN_LIMIT`` summaries. ``InvalidRequest`` for a cursor it never gave out."""
        ...

    def request_slot(
        self, key: str, limit: int, *, lease: float, taken: HeldSlot | None = None
    ) -> AbstractAsyncContextManager[None]:
        """One of ``limit`` slots shared by every request naming ``key`` (a job's request_concurrency), held
        while the context is; waits for a free one. A Redis store shares them across workers and proxies; a
        slot whose holder died is freed after ``lease`` seconds. ``taken``: the slot the turn's session read
        took (``SessionLease.slot``): used instead while it is held, and left held (its lease gives it back)."""
        ...

    async def put_teacher_scores(self, session_id: str, response_id: str, scores: TeacherScores) -> bool:
        """Keep a teacher pass of the trajectory ending at ``response_id`` (a later pass replaces it), for as
        long as the session lives, in one round trip; False if the session is gone."""
        ...

    async def get_teacher_scores(self, session_id: str, response_id: str) -> TeacherScores | None:
        """The teacher pass kept for ``response_id``, if any, in one round trip."""
        ...

    async def get_fleet_state(self) -> dict[str, Any] | None:
        """The fleet's shared state as last put (None: never put), in one round trip."""
        ...

    async def put_fleet_state(self, state: Mapping[str, Any]) -> None:
        """Replace the fleet's shared state (a JSON object), in one round trip."""
        ...

    async def ping(self) -> bool:
        """Whether the store answers now (for readiness checks); never raises."""
        ...

    async def close(self) -> None: ...
