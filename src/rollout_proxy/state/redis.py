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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import orjson
from redis import asyncio as aioredis
from redis.exceptions import RedisError, ResponseError, WatchError

from rollout_proxy.errors import Conflict, SessionFinished, SessionNotFound
from rollout_proxy.records import ResponseNode, SessionRecord, SessionStatus
from rollout_proxy.state import keys
from rollout_proxy.state.codec import decode_node, encode_node
from rollout_proxy.state.connection import RedisOptions, connect_redis, translate_errors
from rollout_proxy.state.store import Idempotency, json_bytes

#: A path deeper than this is refused (a cycle would otherwise loop in the script).
MAX_DEPTH = 100_000
#: Optimistic-lock retries of a finish before giving up with a 409 (only concurrent finishes collide).
MAX_FINISH_ATTEMPTS = 8

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


def _text(value: bytes | str) -> str:
    """A reply as text. Our clients get bytes (``decode_responses=False``); redis-py types replies as either."""
    return value.decode() if isinstance(value, bytes) else value


class RedisStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._get_path = client.register_script(_GET_PATH)
        self._put_node = client.register_script(_PUT_NODE)

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
        await self._redis.set(
            keys.session_key(session.id), orjson.dumps(session.to_dict()), pxat=int(session.expires_at * 1000)
        )

    @translate_errors
    async def get_session(self, session_id: str) -> SessionRecord | None:
        raw = await self._redis.get(keys.session_key(session_id))
        return None if raw is None else SessionRecord.from_dict(orjson.loads(raw))

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
                        return session if sent is not None and raw == sent else None
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
