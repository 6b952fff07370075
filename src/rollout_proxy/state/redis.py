"""The Redis store: the response tree survives proxy restarts and is shared by replicas.

Reads of a path are one round trip (a script walks the parent links server-side);
a node write is one atomic script that also checks the session still exists and is
open, claims the request's idempotency key, and gives the new keys the session's
remaining time to live; finishing a session is an optimistic (WATCH/MULTI)
compare-and-set, so it happens once, and it sets the session's "finished" marker key
in the same transaction. The script checks that marker (one EXISTS) rather than
decoding the session's JSON with cjson on every turn: the record carries the sample's
messages and tools, so its size is the client's to choose, and cjson's number and
nesting rules differ from orjson's.

A turn costs two round trips: its session read also reads what the turn reads next
(``ReadAhead``: the path-index entries of its messages and its parent's path, one script), and
its node write also moves the session's engine after a failover. A job's request bound is a
sorted set of leases per job (``request_slot``), shared by every worker and proxy on this Redis. A turn
whose token names its bound (``ReadAhead.bound``) takes its slot in the read's pipeline and gives it back
in the write's, so it still costs two round trips; a full bound costs one more per poll, and a failed
turn gives its slot back on its own when its task ends. On a cluster a pipeline cannot carry scripts of
different slots: there the slot is taken and given back around the engine call, two round trips more.

The session listing has an index of its own (``keys.session_index_keys``): a create writes
the session and its index entry in one pipelined round trip, a finish rewrites the entry's
summary once it has committed (best effort: the index is a view, the session record is the
truth), and the index drops entries as their sessions expire.

A session's images (``keys.images_key``) are written by the node script too, each once by its hash, the
session's bound (``ImageBound``: how many, how many bytes, against a running sum) checked before anything
is written; they expire with the session.

Node blobs are stored zstd-compressed (``--redis-node-compression``, level 3 by default; 0 stores them
plain), about 0.6x the bytes at ~40 µs a turn; either form is read back, whatever the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import orjson
import structlog
from redis import asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError, WatchError

from rollout_proxy.bounded import BoundedCache
from rollout_proxy.errors import Conflict, SessionFinished, SessionNotFound
from rollout_proxy.records import ResponseNode, SessionRecord, SessionStatus, TeacherScores
from rollout_proxy.state import keys, listing
from rollout_proxy.state.codec import (
    BlobCompressor,
    decode_image,
    decode_node,
    decode_scores,
    encode_image,
    encode_node,
    encode_scores,
)
from rollout_proxy.state.connection import ConnectionGate, RedisOptions, connect_redis, translate_errors
from rollout_proxy.state.listing import SessionPage, SessionSummary, Where
from rollout_proxy.state.store import (
    REQUEST_LEASE_S,
    SIBLINGS,
    HeldSlot,
    Idempotency,
    ImageBound,
    ReadAhead,
    RequestBound,
    SessionLease,
    json_bytes,
    new_images,
)
from rollout_proxy.wire.images import ImageBlob

log = structlog.get_logger(__name__)

#: node blobs larger than this are compressed in a worker thread (zstd level 3: ~8 ms a MiB here, 2 to decompress)
OFF_LOOP_COMPRESS_BYTES = 128 * 1024

P = ParamSpec("P")
T = TypeVar("T")

#: A path deeper than this is refused (a cycle would otherwise loop in the script).
MAX_DEPTH = 100_000
#: Optimistic-lock retries of a finish before giving up with a 409 (only concurrent finishes collide).
MAX_FINISH_ATTEMPTS = 8
#: Expired index entries a create drops (at most), so the index keeps up with the expiries.
INDEX_TRIM = 64
#: Index entries read per round trip of a listing.
INDEX_BATCH = 500
#: Seconds between tries for a slot of a full request bound (doubling, with jitter, up to the max).
SLOT_POLL_MIN = 0.005
SLOT_POLL_MAX = 0.1

_SET_ENGINE = """
-- KEYS: session, engine; ARGV: engine URL. The engine key lives as long as the session.
local ttl = redis.call("PTTL", KEYS[1])
if ttl < 0 then return 0 end
redis.call("SET", KEYS[2], ARGV[1], "PX", ttl)
return 1
"""

_PUT_TEACHER = """
-- KEYS: session, teacher; ARGV: response id, packed teacher pass. Kept as long as the session.
local ttl = redis.call("PTTL", KEYS[1])
if ttl < 0 then return 0 end
redis.call("HSET", KEYS[2], ARGV[1], ARGV[2])
redis.call("PEXPIRE", KEYS[2], ttl)
return 1
"""

_ACQUIRE = """
-- KEYS: leases; ARGV: lease id, limit, lease ms. On Redis's clock, so workers' clocks never matter.
local now = redis.call("TIME")
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", ms)
if redis.call("ZCARD", KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call("ZADD", KEYS[1], ms + tonumber(ARGV[3]), ARGV[1])
redis.call("PEXPIRE", KEYS[1], tonumber(ARGV[3]))
return 1
"""

_RENEW = """
-- KEYS: leases; ARGV: lease id, lease ms. Extends a lease still held (never re-adds one given back).
local now = redis.call("TIME")
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local renewed = redis.call("ZADD", KEYS[1], "XX", "CH", ms + tonumber(ARGV[2]), ARGV[1])
redis.call("PEXPIRE", KEYS[1], tonumber(ARGV[2]))
return renewed
"""

_GET_PATH = """
-- KEYS: parents, nodes, routing; ARGV: leaf id, depth limit, "1" to add routing blobs
local ids = {}
local current = ARGV[1]
local limit = tonumber(ARGV[2])
while current ~= "" do
  if #ids >= limit then return redis.error_reply("path deeper than " .. limit) end
  ids[#ids + 1] = current
  local parent = redis.call("HGET", KEYS[1], current)
  if not parent then return {} end
  current = parent
end
local blobs = {}
for i = #ids, 1, -1 do
  blobs[#blobs + 1] = redis.call("HGET", KEYS[2], ids[i])
  if ARGV[3] == "1" then blobs[#blobs + 1] = redis.call("HGET", KEYS[3], ids[i]) end
end
return blobs
"""

_PUT_NODE = """
-- KEYS: session, nodes, parents, paths, latest, routing, finished marker, idempotency, engine, images, image bytes
-- ARGV: id, blob, parent, latest api, routing blob ("" = none),
--       idempotency key ("" = none), its fingerprint, engine to move the session to ("" = stay),
--       n partial, siblings kept, n images, most images, most image bytes,
--       image triples (hash, bytes, packed image), partial pairs, full pairs
-- Returns 1 when written, or what the idempotency key already holds ("<fingerprint> <id>").
-- A full pair whose hash already names another whole node keeps it: "<new>|<older>..." (state.store.SIBLINGS).
-- Images the session does not hold yet are added only within the bound, else nothing is written:
-- "IMAGES <held> <held bytes> <adding> <added bytes>".
local ttl = redis.call("PTTL", KEYS[1])
if ttl < 0 then return redis.error_reply("NOSESSION session expired or unknown") end
if redis.call("EXISTS", KEYS[7]) == 1 then return redis.error_reply("FINISHED session already finished") end
if ARGV[6] ~= "" then
  local held = redis.call("HGET", KEYS[8], ARGV[6])
  if held then return held end
end
local n_images = tonumber(ARGV[11])
local adding, added_bytes, seen = 0, 0, {}
for k = 0, n_images - 1 do
  local at = 14 + 3 * k
  if not seen[ARGV[at]] and redis.call("HEXISTS", KEYS[10], ARGV[at]) == 0 then
    seen[ARGV[at]] = true
    adding = adding + 1
    added_bytes = added_bytes + tonumber(ARGV[at + 1])
  end
end
if adding > 0 then
  local held = redis.call("HLEN", KEYS[10])
  local held_bytes = tonumber(redis.call("GET", KEYS[11]) or "0")
  if held + adding > tonumber(ARGV[12]) or held_bytes + added_bytes > tonumber(ARGV[13]) then
    return redis.error_reply("IMAGES " .. held .. " " .. held_bytes .. " " .. adding .. " " .. added_bytes)
  end
  for k = 0, n_images - 1 do
    local at = 14 + 3 * k
    if redis.call("HSETNX", KEYS[10], ARGV[at], ARGV[at + 2]) == 1 then
      redis.call("INCRBY", KEYS[11], ARGV[at + 1])
    end
  end
  redis.call("PEXPIRE", KEYS[10], ttl)
  redis.call("PEXPIRE", KEYS[11], ttl)
end
if ARGV[6] ~= "" then
  redis.call("HSET", KEYS[8], ARGV[6], ARGV[7] .. " " .. ARGV[1])
  redis.call("PEXPIRE", KEYS[8], ttl)
end
redis.call("HSET", KEYS[2], ARGV[1], ARGV[2])
redis.call("HSET", KEYS[3], ARGV[1], ARGV[3])
if ARGV[5] ~= "" then redis.call("HSET", KEYS[6], ARGV[1], ARGV[5]) end
local n_partial = tonumber(ARGV[9])
local kept_siblings = tonumber(ARGV[10])
local i = 14 + 3 * n_images
for _ = 1, n_partial do
  redis.call("HSETNX", KEYS[4], ARGV[i], ARGV[i + 1])
  i = i + 2
end
while i <= #ARGV do
  local value = ARGV[i + 1]
  local held = redis.call("HGET", KEYS[4], ARGV[i])
  if held and not string.find(held, "#", 1, true) then
    local ids = {value}
    for other in string.gmatch(held, "[^|]+") do
      if other ~= value and #ids < kept_siblings then ids[#ids + 1] = other end
    end
    value = table.concat(ids, "|")
  end
  redis.call("HSET", KEYS[4], ARGV[i], value)
  i = i + 2
end
if ARGV[4] ~= "" then redis.call("HSET", KEYS[5], ARGV[4], ARGV[1], "*", ARGV[1]) end
for k = 2, 6 do redis.call("PEXPIRE", KEYS[k], ttl) end
if ARGV[8] ~= "" then redis.call("SET", KEYS[9], ARGV[8], "PX", ttl) end
return 1
"""

_READ_TURN = """
-- KEYS: session, engine, paths, parents, nodes
-- ARGV: leaf id ("" = the deepest whole-node match of the hashes), depth limit,
--       a node whose path the caller holds ("" = none), path hashes...
-- Returns {} for no session, else: record, engine, n, n index entries, the leaf walked ("" = none),
-- "1" when the walk stopped at the held node (else ""), then the node blobs of the path from the
-- root (or from below the held node) to the leaf (none when the leaf is not in the session).
local session = redis.call("GET", KEYS[1])
if not session then return {} end
local out = {session, redis.call("GET", KEYS[2]), #ARGV - 3}
local leaf = ARGV[1]
for i = 4, #ARGV do
  local value = redis.call("HGET", KEYS[3], ARGV[i])
  out[#out + 1] = value
  if value and ARGV[1] == "" and not string.find(value, "#", 1, true) then
    leaf = string.match(value, "^[^|]+")  -- the newest of the nodes with this path
  end
end
out[#out + 1] = leaf
local ids = {}
local current = leaf
local limit = tonumber(ARGV[2])
local held = ARGV[3]
local stopped = ""
while current ~= "" do
  if current == held then stopped = "1" break end
  if #ids >= limit then return redis.error_reply("path deeper than " .. limit) end
  ids[#ids + 1] = current
  local parent = redis.call("HGET", KEYS[4], current)
  if not parent then out[#out + 1] = "" return out end
  current = parent
end
out[#out + 1] = stopped
for i = #ids, 1, -1 do out[#out + 1] = redis.call("HGET", KEYS[5], ids[i]) end
return out
"""


_INDEX_OPEN = """
-- KEYS: by_created, by_expiry, summaries
-- ARGV: id, created_at, expires_at, summary (JSON), now (times in seconds), most expired entries to drop
local gone = redis.call("ZRANGEBYSCORE", KEYS[2], "-inf", ARGV[5], "LIMIT", 0, tonumber(ARGV[6]))
for _, id in ipairs(gone) do
  redis.call("ZREM", KEYS[1], id)
  redis.call("ZREM", KEYS[2], id)
  redis.call("HDEL", KEYS[3], id)
end
redis.call("ZADD", KEYS[1], ARGV[2], ARGV[1])
redis.call("ZADD", KEYS[2], ARGV[3], ARGV[1])
redis.call("HSET", KEYS[3], ARGV[1], ARGV[4])
-- the index lives as long as its longest-lived session, not longer
local ttl = math.ceil((tonumber(ARGV[3]) - tonumber(ARGV[5])) * 1000)
if ttl > 0 then
  for k = 1, 3 do
    if redis.call("PTTL", KEYS[k]) < ttl then redis.call("PEXPIRE", KEYS[k], ttl) end
  end
end
return #gone
"""

_INDEX_FINISH = """
-- KEYS: summaries; ARGV: id, summary (JSON). An entry already dropped (expired) stays dropped.
if redis.call("HEXISTS", KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call("HSET", KEYS[1], ARGV[1], ARGV[2])
return 1
"""

_INDEX_PAGE = """
-- KEYS: by_created, summaries; ARGV: highest score (inclusive), offset, count
-- Returns (id, score, summary or nil) triples, newest first.
local rows = redis.call("ZREVRANGEBYSCORE", KEYS[1], ARGV[1], "-inf", "WITHSCORES", "LIMIT", ARGV[2], ARGV[3])
local out = {}
for i = 1, #rows, 2 do
  out[#out + 1] = rows[i]
  out[#out + 1] = rows[i + 1]
  out[#out + 1] = redis.call("HGET", KEYS[2], rows[i])
end
return out
"""


def _text(value: bytes | str) -> str:
    """A reply as text. Our clients get bytes (``decode_responses=False``); redis-py types replies as either."""
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    """A reply as bytes (ours always are; redis-py types hash values as either)."""
    return value.encode() if isinstance(value, str) else value


#: Held paths: their bytes (estimated, ``_footprint``) at most, each dropped when its session finishes here,
#: expires, or has left it unused this long (it finished on another worker, or waits on a long tool call:
#: its next turn then reads its whole path, in the same one round trip).
HELD_PATH_BYTES = 64 * 1024 * 1024
HELD_PATH_SESSIONS = 4096
HELD_PATH_IDLE_S = 60.0
#: Seconds between sweeps of the held paths whose time is up.
SWEEP_EVERY = 1.0


class HeldPaths:
    """Per session, one root-to-leaf path of decoded nodes (the latest one this worker saw), bounded by
    sessions and by bytes (the least recently used go first), each kept until its session's expiry (once a
    read has told it) or ``idle`` seconds after its last use, whichever comes first."""

    def __init__(
        self,
        *,
        max_sessions: int = HELD_PATH_SESSIONS,
        max_bytes: int = HELD_PATH_BYTES,
        idle: float = HELD_PATH_IDLE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # path, its footprint, its session's expiry (inf: not known yet)
        self._paths: BoundedCache[str, tuple[list[ResponseNode], int, float]] = BoundedCache(
            max_entries=max_sessions, max_bytes=max_bytes
        )
        self._idle, self._clock = idle, clock

    def __len__(self) -> int:
        return len(self._paths)

    @property
    def bytes(self) -> int:
        return self._paths.bytes

    def get(self, session_id: str) -> list[ResponseNode] | None:
        held = self._paths.get(session_id)
        if held is None:
            return None
        self._paths.get(session_id, until=min(held[2], self._clock() + self._idle))  # used now
        return held[0]

    def hold(self, session_id: str, path: list[ResponseNode]) -> None:
        self._keep(session_id, path, _footprint(path))

    def extend(self, session_id: str, below: list[ResponseNode]) -> None:
        """``below`` continues the held path (its first node is a child of the held leaf): held too."""
        held = self._paths.get(session_id)
        if held is not None and below and held[0][-1].id == below[0].parent_id:
            self._keep(session_id, [*held[0], *below], held[1] + _footprint(below))

    def expires(self, session_id: str, expires_at: float) -> None:
        """The session's expiry, as a read found it: its held path is kept no longer."""
        held = self._paths.get(session_id)
        if held is not None and held[2] != expires_at:
            self._keep(session_id, held[0], held[1], expires_at)

    def drop(self, session_id: str) -> None:
        self._paths.pop(session_id)

    def expire(self) -> int:
        return self._paths.expire(self._clock())

    def _keep(self, session_id: str, path: list[ResponseNode], size: int, expires_at: float | None = None) -> None:
        if expires_at is None:  # the session's, as held before (a new root keeps it)
            previous = self._paths.get(session_id)
            expires_at = math.inf if previous is None else previous[2]
        until = min(expires_at, self._clock() + self._idle)
        self._paths.put(session_id, (path, size, expires_at), size=size, until=until)


def _footprint(nodes: Sequence[ResponseNode]) -> int:
    """About what decoded nodes keep alive: their arrays (the token ids twice: a conversation's leaf also
    carries the whole path's, ``ResponseNode.path_ids``), their messages' text a few times over (as decoded,
    and the objects around it), and the rest of each node."""
    total = 0
    for node in nodes:
        total += 2 * (node.prompt_ids.nbytes + node.output_ids.nbytes) + node.output_logprobs.nbytes + 1000
        if node.output_topk is not None:
            total += node.output_topk.ids.nbytes + node.output_topk.logprobs.nbytes
        if node.routing is not None:
            total += node.routing.nbytes
        for message in node.messages:
            content = message.get("content")
            total += 3 * (len(content) if isinstance(content, str) else len(orjson.dumps(content))) + 400
            for call in message.get("tool_calls") or ():
                total += 3 * len(str(call)) + 200
    return total


@dataclass(eq=False, slots=True)
class _Slot:
    """A request slot a session read took for its turn (``ReadAhead.bound``), its lease's: the turn's
    ``request_slot`` uses it; its node write, ``give_back`` or else its task's end gives it back
    (``given_back`` once one has)."""

    key: str
    leases: str
    lease_id: str
    store: RedisStore
    renewing: asyncio.Task[None] | None = None
    given_back: bool = False

    @property
    def held(self) -> bool:
        return not self.given_back

    def let_go(self) -> bool:
        """Mark it given back (stop renewing); False if it already was."""
        if self.given_back:
            return False
        self.given_back = True
        if self.renewing is not None:
            self.renewing.cancel()
        return True

    async def give_back(self) -> None:
        if self.let_go():
            await asyncio.shield(self.store._give_back_slot(self.leases, self.lease_id))


@dataclass(slots=True)
class _TurnRead:
    """What a turn's session read brought back (``RedisStore.lease_session``)."""

    record: bytes | str | None = None
    engine: bytes | str | None = None
    matches: tuple[tuple[str, ...], list[str | None]] | None = None
    leaf: str | None = None
    path: list[ResponseNode] | None = None
    slot: _Slot | None = None


def _lease_ms(lease: float) -> int:
    return max(1, int(lease * 1000))


def _store_call(
    call: Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, T]]:
    """A store method: within the connection gate (a cluster's), with Redis failures translated."""
    translated = translate_errors(call)

    @functools.wraps(call)
    async def gated(store: RedisStore, *args: P.args, **kwargs: P.kwargs) -> T:
        if store._gate is None:
            return await translated(store, *args, **kwargs)
        async with store._gate.held():
            return await translated(store, *args, **kwargs)

    return gated


class RedisStore:
    def __init__(
        self, client: aioredis.Redis, *, options: RedisOptions | None = None, image_bound: ImageBound | None = None
    ) -> None:
        self._redis = client
        self._image_bound = image_bound or ImageBound()
        self._cluster = isinstance(client, RedisCluster)
        # a blocking pool waits by itself; a cluster's per-node pools do not: a store call waits here instead
        options = options or RedisOptions()
        self._gate = ConnectionGate(options.max_connections, options.pool_timeout) if self._cluster else None
        self._giving_back: set[asyncio.Task[None]] = set()  # slots of tasks that ended without a node write
        # per session, the path of its latest node as this worker last read or wrote it (nodes never change):
        # a turn's read then brings only what other workers added below it
        self._paths = HeldPaths()
        self._sweeper: asyncio.Task[None] | None = None  # drops the held paths left unused; from the first one
        # node blobs zstd-compressed (options.node_compression); its contexts serve this event loop only
        self._blobs = BlobCompressor(options.node_compression)
        self._read_turn = client.register_script(_READ_TURN)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._get_path = client.register_script(_GET_PATH)
        self._put_node = client.register_script(_PUT_NODE)
        self._set_engine = client.register_script(_SET_ENGINE)
        self._put_teacher = client.register_script(_PUT_TEACHER)
        self._index_open = client.register_script(_INDEX_OPEN)
        self._index_finish = client.register_script(_INDEX_FINISH)
        self._index_page = client.register_script(_INDEX_PAGE)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        retries: int = 5,
        delay: float = 0.5,
        options: RedisOptions | None = None,
        image_bound: ImageBound | None = None,
    ) -> RedisStore:
        """Connect and ping, retrying while the server comes up."""
        client = await connect_redis(url, retries=retries, delay=delay, options=options)
        return cls(client, options=options, image_bound=image_bound)

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(), name="redis-held-paths")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            self._paths.expire()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._giving_back:
            await asyncio.gather(*self._giving_back, return_exceptions=True)
        await self._redis.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    @_store_call
    async def get_fleet_state(self) -> dict[str, Any] | None:
        raw = await self._redis.get(keys.fleet_state_key())
        return None if raw is None else orjson.loads(raw)

    @_store_call
    async def put_fleet_state(self, state: Mapping[str, Any]) -> None:
        await self._redis.set(keys.fleet_state_key(), json_bytes(dict(state), "the fleet state"))

    @_store_call
    async def create_session(self, session: SessionRecord) -> None:
        """The record and its index entry, pipelined: one round trip (two keyspaces, so no MULTI on a cluster)."""
        summary = listing.opened(session)
        index_args: list[str | bytes | int] = [
            session.id,
            repr(session.created_at),
            repr(session.expires_at),
            orjson.dumps(summary.to_dict()),
            repr(time.time()),
            INDEX_TRIM,
        ]
        index_keys = keys.session_index_keys()
        record, expires = orjson.dumps(session.to_dict()), int(session.expires_at * 1000)
        stored: object
        indexed: object
        if self._cluster:  # a cluster pipeline refuses scripts; one after the other, a call holds one connection
            await self._redis.set(keys.session_key(session.id), record, pxat=expires)
            stored = True
            try:
                indexed = await self._index_open(keys=index_keys, args=index_args)
            except RedisError as exc:
                indexed = exc
        else:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(keys.session_key(session.id), record, pxat=expires)
                # EVALSHA straight: a script registered with the pipeline would cost a SCRIPT EXISTS round trip
                pipe.evalsha(self._index_open.sha, len(index_keys), *index_keys, *index_args)
                stored, indexed = await pipe.execute(raise_on_error=False)
        if isinstance(stored, BaseException):
            raise stored
        if isinstance(indexed, NoScriptError):  # a server that has not seen the script yet (once)
            await self._index_open(keys=index_keys, args=index_args)
        elif isinstance(indexed, Exception):  # the session is stored: the listing's view of it is all that is missing
            log.warning(
                "session_index_not_written", session_id=session.id, error=f"{type(indexed).__name__}: {indexed}"
            )

    @_store_call
    async def get_session(self, session_id: str) -> SessionRecord | None:
        """The record, with the engine a failover moved it to (one MGET: both keys share the session's slot)."""
        raw, engine = await self._redis.mget(keys.session_key(session_id), keys.engine_key(session_id))
        return _session(raw, engine)

    @_store_call
    async def lease_session(self, session_id: str, read_ahead: ReadAhead) -> SessionLease | None:
        """One script that reads the record and the turn's path-index entries and parent path (pipelined
        with the slot's take when ``read_ahead`` names a bound)."""
        read = await self._read_ahead(session_id, read_ahead)
        session, slot = _session(read.record, read.engine), read.slot
        if slot is not None and (
            session is None or session.status is not SessionStatus.OPEN or not _bounded(session, slot.key)
        ):
            await slot.give_back()  # no turn will use it: given back now
            slot = None
        if session is None:
            return None
        self._paths.expires(session_id, session.expires_at)
        return SessionLease(session, matches=read.matches, leaf=read.leaf, path=read.path, slot=slot)

    async def _read_ahead(self, session_id: str, ahead: ReadAhead) -> _TurnRead:
        turn_keys = [
            keys.session_key(session_id),
            keys.engine_key(session_id),
            keys.paths_key(session_id),
            keys.parents_key(session_id),
            keys.nodes_key(session_id),
        ]
        held = self._paths.get(session_id)
        turn_args: list[str | int] = [ahead.response_id or "", MAX_DEPTH, held[-1].id if held else "", *ahead.hashes]
        slot = self._slot_to_take(ahead.bound)
        if slot is None or ahead.bound is None:
            rows = await self._read_turn(keys=turn_keys, args=turn_args)
        else:
            rows = await self._read_and_take(turn_keys, turn_args, slot, ahead.bound.limit)
        read = _TurnRead(slot=slot if slot is not None and slot.renewing is not None else None)  # taken or not
        if not rows:
            return read
        n = int(rows[2])
        matches = [None if value is None else _text(value) for value in rows[3 : 3 + n]]
        leaf, stopped, blobs = _text(rows[3 + n]), rows[4 + n], rows[5 + n :]
        below = [self._decode(_bytes(blob)) for blob in blobs]
        path: list[ResponseNode] | None = None
        if stopped and held:  # the walk met the path this worker holds: only the nodes below it came
            path = [*held, *below]
            self._paths.extend(session_id, below)
        elif below:
            path = below
            self._paths.hold(session_id, path)
            self._start_sweeper()
        read.record, read.engine = rows[0], rows[1]
        if ahead.hashes:
            read.matches = (tuple(ahead.hashes), matches)
        if leaf:
            read.leaf, read.path = leaf, path
        return read

    def _slot_to_take(self, bound: RequestBound | None) -> _Slot | None:
        """The slot a session read should take with it: none on a cluster (see the module)."""
        if bound is None or self._cluster:
            return None
        return _Slot(bound.key, keys.request_leases_key(bound.key), uuid.uuid4().hex, self)

    async def _read_and_take(
        self, turn_keys: list[str], turn_args: list[str | int], slot: _Slot, limit: int
    ) -> list[Any]:
        """The turn's read and the slot's take, pipelined: one round trip. A full bound takes nothing: the
        turn then waits for a slot at its engine call (``request_slot``)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                # EVALSHA straight: a script registered with the pipeline would cost a SCRIPT EXISTS round trip
                pipe.evalsha(self._read_turn.sha, len(turn_keys), *turn_keys, *turn_args)
                pipe.evalsha(self._acquire.sha, 1, slot.leases, slot.lease_id, limit, _lease_ms(REQUEST_LEASE_S))
                rows, taken = await pipe.execute(raise_on_error=False)
            if isinstance(taken, NoScriptError):  # a server that has not seen the script yet (once)
                taken = await self._acquire(keys=[slot.leases], args=[slot.lease_id, limit, _lease_ms(REQUEST_LEASE_S)])
        except BaseException:  # perhaps taken before the reply was lost: given back (else its lease runs out)
            await asyncio.shield(self._give_back_slot(slot.leases, slot.lease_id))
            raise
        if taken == 1:
            self._hold(slot)
        elif isinstance(taken, Exception):  # the read stands; the turn takes its slot at the engine call
            log.warning("request_slot_not_taken", error=f"{type(taken).__name__}: {taken}")
        if isinstance(rows, NoScriptError):
            rows = await self._read_turn(keys=turn_keys, args=turn_args)
        elif isinstance(rows, Exception):
            raise rows
        return list(rows)

    def _hold(self, slot: _Slot) -> None:
        """The slot is the lease's: renewed while held, given back by its node write or close, or else when
        the task that took it ends."""
        slot.renewing = asyncio.create_task(
            self._renew_slot(slot.leases, slot.lease_id, REQUEST_LEASE_S), name="request-slot-lease"
        )
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(lambda _: self._give_back_later(slot))

    def _give_back_later(self, slot: _Slot) -> None:
        """At its task's end, a slot no node write gave back (the turn failed, or never reached the engine)."""
        if not slot.let_go():
            return
        giving_back = asyncio.get_running_loop().create_task(self._give_back_slot(slot.leases, slot.lease_id))
        self._giving_back.add(giving_back)
        giving_back.add_done_callback(self._giving_back.discard)

    @contextlib.asynccontextmanager
    async def request_slot(
        self, key: str, limit: int, *, lease: float, taken: HeldSlot | None = None
    ) -> AsyncIterator[None]:
        """A lease in Redis: taken by a script (one round trip while there is room; a full bound is polled
        with backoff), given back with ZREM; a holder that died frees its slot when the lease runs out.
        The slot the turn's session read took for ``key`` (``taken``) is used as it is (no round trip)."""
        if taken is not None and taken.held and taken.key == key:
            yield  # given back with the node write, by its lease, or when the task ends
            return
        leases, lease_id = keys.request_leases_key(key), uuid.uuid4().hex
        pause = SLOT_POLL_MIN
        try:
            while not await self._try_slot(leases, lease_id, limit, lease):
                await asyncio.sleep(pause * random.uniform(0.5, 1.0))
                pause = min(pause * 2, SLOT_POLL_MAX)
        except BaseException:  # cancelled or failed, perhaps after the script took it: give it back
            await asyncio.shield(self._give_back_slot(leases, lease_id))
            raise
        renewing = asyncio.create_task(self._renew_slot(leases, lease_id, lease), name="request-slot-lease")
        try:
            yield
        finally:
            renewing.cancel()
            await asyncio.shield(self._give_back_slot(leases, lease_id))

    async def _renew_slot(self, leases: str, lease_id: str, lease: float) -> None:
        """While the slot is held, its lease is extended every third of it: only a dead holder's runs out."""
        while True:
            await asyncio.sleep(lease / 3)
            try:
                await self._renew(keys=[leases], args=[lease_id, _lease_ms(lease)])
            except (RedisError, OSError) as exc:  # the next try may reach it; the lease covers two misses
                log.warning("request_slot_not_renewed", error=f"{type(exc).__name__}: {exc}")

    @_store_call
    async def _try_slot(self, leases: str, lease_id: str, limit: int, lease: float) -> bool:
        return bool(await self._acquire(keys=[leases], args=[lease_id, limit, _lease_ms(lease)]))

    async def _give_back_slot(self, leases: str, lease_id: str) -> None:
        """Best effort: a slot not given back (Redis down) is freed when its lease runs out."""
        try:
            await self._redis.zrem(leases, lease_id)
        except (RedisError, OSError) as exc:
            log.warning("request_slot_not_released", error=f"{type(exc).__name__}: {exc}")

    @_store_call
    async def set_session_engine(self, session_id: str, engine: str) -> bool:
        keys_ = [keys.session_key(session_id), keys.engine_key(session_id)]
        return bool(await self._set_engine(keys=keys_, args=[engine]))

    @_store_call
    async def put_teacher_scores(self, session_id: str, response_id: str, scores: TeacherScores) -> bool:
        keys_ = [keys.session_key(session_id), keys.teacher_key(session_id)]
        return bool(await self._put_teacher(keys=keys_, args=[response_id, encode_scores(scores)]))

    @_store_call
    async def get_teacher_scores(self, session_id: str, response_id: str) -> TeacherScores | None:
        blob = await self._redis.hget(keys.teacher_key(session_id), response_id)
        return None if blob is None else decode_scores(_bytes(blob))

    @_store_call
    async def finish_session(self, session_id: str, result: dict) -> SessionRecord | None:
        self._paths.drop(session_id)  # no turn follows a finish
        finished = await self._commit_finish(session_id, result)
        if finished is not None:  # once the transaction's connection is back in the pool: a finish holds one
            await self._index_finished(finished)
        return finished

    async def _commit_finish(self, session_id: str, result: dict) -> SessionRecord | None:
        key = keys.session_key(session_id)
        sent: bytes | None = None  # what an attempt committed, if its EXEC's reply was lost with the connection
        async with self._redis.pipeline(transaction=True) as pipe:
            for _ in range(MAX_FINISH_ATTEMPTS):
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        return None
                    session = SessionRecord.from_dict(orjson.loads(raw))
                    if session.status is not SessionStatus.OPEN:
                        # our own earlier EXEC committed and only its reply was lost: that is a success
                        if sent is None or raw != sent:
                            return None
                        return session
                    session = dataclasses.replace(session, status=SessionStatus.FINISHED, result=result)
                    record = json_bytes(session.to_dict(), "the rollout result")
                    pipe.multi()
                    sent = record
                    pipe.set(key, record, keepttl=True)
                    pipe.set(keys.finished_key(session_id), b"1", pxat=int(session.expires_at * 1000))
                    await pipe.execute()
                    return session
                except WatchError:
                    continue  # someone else touched the session: read it again
        raise Conflict(
            f"session {session_id!r} kept changing while it was being finished; try again", param="session_id"
        )

    async def _index_finished(self, session: SessionRecord) -> None:
        """The finished session's summary, from its whole tree; best effort, as the finish has committed."""
        try:
            blobs = await self._redis.hgetall(keys.nodes_key(session.id))
            summary = listing.summarize(session, (self._decode(_bytes(blob)) for blob in blobs.values()))
            await self._index_finish(
                keys=[keys.session_summary_key()], args=[session.id, orjson.dumps(summary.to_dict())]
            )
        except (RedisError, OSError) as exc:
            log.warning("session_index_not_updated", session_id=session.id, error=f"{type(exc).__name__}: {exc}")

    async def _encode(self, node: ResponseNode) -> tuple[bytes, bytes | None]:
        """The node's blob as stored (compressed; off the event loop when it is large) and its routing blob."""
        blob, routing = encode_node(node)
        if len(blob) <= OFF_LOOP_COMPRESS_BYTES or not self._blobs.level:
            return self._blobs.compress(blob), routing
        return await asyncio.to_thread(BlobCompressor(self._blobs.level).compress, blob), routing

    def _decode(self, blob: bytes, routing: bytes | None = None) -> ResponseNode:
        return decode_node(blob, routing, compressor=self._blobs)

    @_store_call
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
        slot = None
        if lease is not None:
            lease.written()
            slot = lease.slot
        try:
            blob, routing = await self._encode(node)
        except BaseException:
            if lease is not None:
                await lease.close()
            raise
        args: list[str | bytes | int] = [
            node.id,
            blob,
            node.parent_id or "",
            latest or "",
            routing or b"",
            idempotency.key if idempotency else "",
            idempotency.fingerprint if idempotency else "",
            engine or "",
            len(partial_paths),
            SIBLINGS,
        ]
        adding = new_images(images, ())
        args += [len(adding), self._image_bound.count, self._image_bound.bytes]
        for image in adding:
            args += [image.sha256, len(image.data), encode_image(image)]
        for entries in (partial_paths, paths):
            for path_hash, value in entries.items():
                args += [path_hash, value]
        try:
            if isinstance(slot, _Slot) and slot.let_go():  # the turn is done with its request slot
                written = await self._write_node_and_give_back(keys.session_keys(session_id), args, slot)
            else:
                written = await self._put_node(keys=keys.session_keys(session_id), args=args)
        except ResponseError as exc:
            if "NOSESSION" in str(exc):
                raise SessionNotFound(
                    f"session {session_id!r} not found (unknown or expired)", param="session_id"
                ) from None
            if "FINISHED" in str(exc):
                raise SessionFinished(f"session {session_id!r} is already finished", param="session_id") from None
            if str(exc).startswith("IMAGES "):
                held, held_bytes, adding_n, added = (int(value) for value in str(exc).split()[1:5])
                raise self._image_bound.refusal(held, held_bytes, adding_n, added) from None
            raise
        if written == 1:  # the session's new leaf: a root starts a path, a child extends the held one
            if node.parent_id is None:
                self._paths.hold(session_id, [node])
                self._start_sweeper()
            else:
                self._paths.extend(session_id, [node])
        if idempotency is None or written == 1:
            return node.id
        fingerprint, response_id = _text(written).split(" ", 1)
        return idempotency.replay(fingerprint, response_id)

    async def _write_node_and_give_back(self, node_keys: list[str], args: list[Any], slot: _Slot) -> Any:
        """The node script and the slot's give-back, pipelined: one round trip (the slot goes back whether
        or not the write succeeds)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.evalsha(self._put_node.sha, len(node_keys), *node_keys, *args)
                pipe.zrem(slot.leases, slot.lease_id)
                written, given_back = await pipe.execute(raise_on_error=False)
        except BaseException:
            await asyncio.shield(self._give_back_slot(slot.leases, slot.lease_id))
            raise
        if isinstance(given_back, Exception):  # its lease runs out instead
            log.warning("request_slot_not_released", error=f"{type(given_back).__name__}: {given_back}")
        if isinstance(written, NoScriptError):  # a server that has not seen the script yet (once)
            return await self._put_node(keys=node_keys, args=args)
        if isinstance(written, Exception):
            raise written
        return written

    @_store_call
    async def check_images(self, session_id: str, images: Sequence[ImageBlob]) -> None:
        """The count, the bytes and which of ``images`` are held: one pipelined round trip."""
        distinct = new_images(images, ())
        if not distinct:
            return
        images_key = keys.images_key(session_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hlen(images_key)
            pipe.get(keys.image_bytes_key(session_id))
            for image in distinct:
                pipe.hexists(images_key, image.sha256)
            held, held_bytes, *present = await pipe.execute()
        adding = [image for image, there in zip(distinct, present, strict=True) if not there]
        self._image_bound.check(int(held), int(held_bytes or 0), adding)

    @_store_call
    async def get_images(self, session_id: str, hashes: Sequence[str]) -> dict[str, ImageBlob]:
        if not hashes:
            return {}
        blobs = await self._redis.hmget(keys.images_key(session_id), list(hashes))
        return {
            sha: decode_image(_bytes(blob), sha) for sha, blob in zip(hashes, blobs, strict=True) if blob is not None
        }

    @_store_call
    async def get_path(self, session_id: str, node_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        blobs = await self._get_path(
            keys=[keys.parents_key(session_id), keys.nodes_key(session_id), keys.routing_key(session_id)],
            args=[node_id, MAX_DEPTH, "1" if routing else "0"],
        )
        if not blobs:
            return None
        if not routing:
            return [self._decode(blob) for blob in blobs]
        return [self._decode(blob, rows or None) for blob, rows in zip(blobs[::2], blobs[1::2], strict=True)]

    @_store_call
    async def match_paths(self, session_id: str, hashes: Sequence[str]) -> list[str | None]:
        if not hashes:
            return []
        values = await self._redis.hmget(keys.paths_key(session_id), list(hashes))
        return [None if value is None else _text(value) for value in values]

    @_store_call
    async def latest(self, session_id: str, api: str) -> str | None:
        value = await self._redis.hget(keys.latest_key(session_id), api)
        return None if value is None else _text(value)

    @_store_call
    async def get_nodes(self, session_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.exists(keys.session_key(session_id))
            pipe.hgetall(keys.nodes_key(session_id))
            if routing:
                pipe.hgetall(keys.routing_key(session_id))
            exists, blobs, *rows = await pipe.execute()
        if not exists:
            return None
        by_node = {_text(node_id): _bytes(blob) for node_id, blob in rows[0].items()} if rows else {}
        nodes = (self._decode(_bytes(blob), by_node.get(_text(node_id))) for node_id, blob in blobs.items())
        return sorted(nodes, key=lambda node: node.created_at)

    @_store_call
    async def list_sessions(self, where: Where, *, cursor: str | None = None, limit: int = 50) -> SessionPage:
        position = listing.decode_cursor(cursor) if cursor is not None else None
        scan = listing.Scan(where, limit, time.time())
        offset = 0
        while True:
            top = "+inf" if position is None else repr(position[0])
            rows = await self._index_page(
                keys=[keys.session_index_key(), keys.session_summary_key()], args=[top, offset, INDEX_BATCH]
            )
            if not rows:
                return scan.page(exhausted=True)
            triples = [(float(rows[i + 1]), _text(rows[i]), rows[i + 2]) for i in range(0, len(rows), 3)]
            # rows at the cursor's own time that it already covers come first: skip them
            fresh = [row for row in triples if position is None or (row[0], row[1]) < position]
            if not fresh:  # a whole batch of one timestamp: look further along it
                offset += len(triples)
                continue
            offset = 0
            for created_at, session_id, blob in fresh:
                position = (created_at, session_id)
                if blob is None:  # dropped from the index meanwhile
                    continue
                if not scan.offer(SessionSummary.from_dict(orjson.loads(blob))):
                    return scan.page(exhausted=False)


def _bounded(session: SessionRecord, key: str) -> bool:
    """Whether the session's own bound is the one its token named (the record, not the token, decides)."""
    bound = RequestBound.of(session.concurrency)
    return bound is not None and bound.key == key


def _session(raw: bytes | str | None, engine: bytes | str | None) -> SessionRecord | None:
    """The record as read, with the engine a failover moved it to."""
    session = None if raw is None else SessionRecord.from_dict(orjson.loads(raw))
    if session is not None and engine is not None:
        session.engine = _text(engine)
    return session
