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

The session listing has an index of its own (``keys.session_index_keys``): a create writes
the session and its index entry in one pipelined round trip, a finish rewrites the entry's
summary once it has committed (best effort: the index is a view, the session record is the
truth), and the index drops entries as their sessions expire.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import orjson
import structlog
from redis import asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError, ResponseError, WatchError

from rollout_proxy.errors import Conflict, SessionFinished, SessionNotFound
from rollout_proxy.records import ResponseNode, SessionRecord, SessionStatus
from rollout_proxy.state import keys, listing
from rollout_proxy.state.codec import decode_node, encode_node
from rollout_proxy.state.connection import RedisOptions, connect_redis, translate_errors
from rollout_proxy.state.listing import SessionPage, SessionSummary, Where
from rollout_proxy.state.store import Idempotency, json_bytes

log = structlog.get_logger(__name__)

#: A path deeper than this is refused (a cycle would otherwise loop in the script).
MAX_DEPTH = 100_000
#: Optimistic-lock retries of a finish before giving up with a 409 (only concurrent finishes collide).
MAX_FINISH_ATTEMPTS = 8
#: Expired index entries a create drops (at most), so the index keeps up with the expiries.
INDEX_TRIM = 64
#: Index entries read per round trip of a listing.
INDEX_BATCH = 500

_SET_ENGINE = """
-- KEYS: session, engine; ARGV: engine URL. The engine key lives as long as the session.
local ttl = redis.call("PTTL", KEYS[1])
if ttl < 0 then return 0 end
redis.call("SET", KEYS[2], ARGV[1], "PX", ttl)
return 1
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
-- KEYS: session, nodes, parents, paths, latest, routing, finished marker, idempotency
-- ARGV: id, blob, parent, latest api, routing blob ("" = none),
--       idempotency key ("" = none), its fingerprint, n partial, partial pairs, full pairs
-- Returns 1 when written, or what the idempotency key already holds ("<fingerprint> <id>").
local ttl = redis.call("PTTL", KEYS[1])
if ttl < 0 then return redis.error_reply("NOSESSION session expired or unknown") end
if redis.call("EXISTS", KEYS[7]) == 1 then return redis.error_reply("FINISHED session already finished") end
if ARGV[6] ~= "" then
  local held = redis.call("HGET", KEYS[8], ARGV[6])
  if held then return held end
  redis.call("HSET", KEYS[8], ARGV[6], ARGV[7] .. " " .. ARGV[1])
  redis.call("PEXPIRE", KEYS[8], ttl)
end
redis.call("HSET", KEYS[2], ARGV[1], ARGV[2])
redis.call("HSET", KEYS[3], ARGV[1], ARGV[3])
if ARGV[5] ~= "" then redis.call("HSET", KEYS[6], ARGV[1], ARGV[5]) end
local n_partial = tonumber(ARGV[8])
local i = 9
for _ = 1, n_partial do
  redis.call("HSETNX", KEYS[4], ARGV[i], ARGV[i + 1])
  i = i + 2
end
while i <= #ARGV do
  redis.call("HSET", KEYS[4], ARGV[i], ARGV[i + 1])
  i = i + 2
end
if ARGV[4] ~= "" then redis.call("HSET", KEYS[5], ARGV[4], ARGV[1], "*", ARGV[1]) end
for k = 2, 6 do redis.call("PEXPIRE", KEYS[k], ttl) end
return 1
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


class RedisStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._get_path = client.register_script(_GET_PATH)
        self._put_node = client.register_script(_PUT_NODE)
        self._set_engine = client.register_script(_SET_ENGINE)
        self._index_open = client.register_script(_INDEX_OPEN)
        self._index_finish = client.register_script(_INDEX_FINISH)
        self._index_page = client.register_script(_INDEX_PAGE)

    @classmethod
    async def connect(
        cls, url: str, *, retries: int = 5, delay: float = 0.5, options: RedisOptions | None = None
    ) -> RedisStore:
        """Connect and ping, retrying while the server comes up."""
        return cls(await connect_redis(url, retries=retries, delay=delay, options=options))

    async def close(self) -> None:
        await self._redis.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    @translate_errors
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
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(keys.session_key(session.id), orjson.dumps(session.to_dict()), pxat=int(session.expires_at * 1000))
            # EVALSHA straight: a script registered with the pipeline would cost a SCRIPT EXISTS round trip each time
            pipe.evalsha(self._index_open.sha, len(index_keys), *index_keys, *index_args)
            stored, indexed = await pipe.execute(raise_on_error=False)
        if isinstance(stored, Exception):
            raise stored
        if isinstance(indexed, NoScriptError):  # a server that has not seen the script yet (once)
            await self._index_open(keys=index_keys, args=index_args)
        elif isinstance(indexed, Exception):  # the session is stored: the listing's view of it is all that is missing
            log.warning(
                "session_index_not_written", session_id=session.id, error=f"{type(indexed).__name__}: {indexed}"
            )

    @translate_errors
    async def get_session(self, session_id: str) -> SessionRecord | None:
        """The record, with the engine a failover moved it to (one MGET: both keys share the session's slot)."""
        raw, engine = await self._redis.mget(keys.session_key(session_id), keys.engine_key(session_id))
        if raw is None:
            return None
        session = SessionRecord.from_dict(orjson.loads(raw))
        if engine is not None:
            session.engine = _text(engine)
        return session

    @translate_errors
    async def set_session_engine(self, session_id: str, engine: str) -> bool:
        keys_ = [keys.session_key(session_id), keys.engine_key(session_id)]
        return bool(await self._set_engine(keys=keys_, args=[engine]))

    @translate_errors
    async def finish_session(self, session_id: str, result: dict) -> SessionRecord | None:
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
                        await self._index_finished(session)
                        return session
                    session = dataclasses.replace(session, status=SessionStatus.FINISHED, result=result)
                    record = json_bytes(session.to_dict(), "the rollout result")
                    pipe.multi()
                    sent = record
                    pipe.set(key, record, keepttl=True)
                    pipe.set(keys.finished_key(session_id), b"1", pxat=int(session.expires_at * 1000))
                    await pipe.execute()
                    await self._index_finished(session)
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
            summary = listing.summarize(session, (decode_node(_bytes(blob)) for blob in blobs.values()))
            await self._index_finish(
                keys=[keys.session_summary_key()], args=[session.id, orjson.dumps(summary.to_dict())]
            )
        except (RedisError, OSError) as exc:
            log.warning("session_index_not_updated", session_id=session.id, error=f"{type(exc).__name__}: {exc}")

    @translate_errors
    async def put_node(
        self,
        session_id: str,
        node: ResponseNode,
        *,
        paths: Mapping[str, str],
        partial_paths: Mapping[str, str],
        latest: str | None,
        idempotency: Idempotency | None = None,
    ) -> str:
        blob, routing = encode_node(node)
        args: list[str | bytes | int] = [
            node.id,
            blob,
            node.parent_id or "",
            latest or "",
            routing or b"",
            idempotency.key if idempotency else "",
            idempotency.fingerprint if idempotency else "",
            len(partial_paths),
        ]
        for entries in (partial_paths, paths):
            for path_hash, value in entries.items():
                args += [path_hash, value]
        try:
            written = await self._put_node(keys=keys.session_keys(session_id), args=args)
        except ResponseError as exc:
            if "NOSESSION" in str(exc):
                raise SessionNotFound(
                    f"session {session_id!r} not found (unknown or expired)", param="session_id"
                ) from None
            if "FINISHED" in str(exc):
                raise SessionFinished(f"session {session_id!r} is already finished", param="session_id") from None
            raise
        if idempotency is None or written == 1:
            return node.id
        fingerprint, response_id = _text(written).split(" ", 1)
        return idempotency.replay(fingerprint, response_id)

    @translate_errors
    async def get_path(self, session_id: str, node_id: str, *, routing: bool = False) -> list[ResponseNode] | None:
        blobs = await self._get_path(
            keys=[keys.parents_key(session_id), keys.nodes_key(session_id), keys.routing_key(session_id)],
            args=[node_id, MAX_DEPTH, "1" if routing else "0"],
        )
        if not blobs:
            return None
        if not routing:
            return [decode_node(blob) for blob in blobs]
        return [decode_node(blob, rows or None) for blob, rows in zip(blobs[::2], blobs[1::2], strict=True)]

    @translate_errors
    async def match_paths(self, session_id: str, hashes: Sequence[str]) -> list[str | None]:
        if not hashes:
            return []
        values = await self._redis.hmget(keys.paths_key(session_id), list(hashes))
        return [None if value is None else _text(value) for value in values]

    @translate_errors
    async def latest(self, session_id: str, api: str) -> str | None:
        value = await self._redis.hget(keys.latest_key(session_id), api)
        return None if value is None else _text(value)

    @translate_errors
    async def get_nodes(self, session_id: str) -> list[ResponseNode] | None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.exists(keys.session_key(session_id))
            pipe.hgetall(keys.nodes_key(session_id))
            exists, blobs = await pipe.execute()
        if not exists:
            return None
        return sorted((decode_node(_bytes(blob)) for blob in blobs.values()), key=lambda node: node.created_at)

    @translate_errors
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
