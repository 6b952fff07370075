"""The whole Redis key namespace.

Every key of a session carries the session id as a cluster hash tag, so a session
lives in one slot: multi-key transactions and the path-walking script stay legal
on Redis Cluster, and a session's keys expire together.
"""

from __future__ import annotations

PREFIX = "rp"


def session_key(session_id: str) -> str:
    """String: the session record (JSON)."""
    return f"{PREFIX}:{{{session_id}}}:session"


def nodes_key(session_id: str) -> str:
    """Hash: response id -> packed node."""
    return f"{PREFIX}:{{{session_id}}}:nodes"


def routing_key(session_id: str) -> str:
    """Hash: response id -> packed MoE routing rows (read only to build trajectories)."""
    return f"{PREFIX}:{{{session_id}}}:routing"


def parents_key(session_id: str) -> str:
    """Hash: response id -> parent response id ("" for a child of the root)."""
    return f"{PREFIX}:{{{session_id}}}:parents"


def paths_key(session_id: str) -> str:
    """Hash: message-path hash -> response id ("id" at a node's end, "id#k" inside it)."""
    return f"{PREFIX}:{{{session_id}}}:paths"


def latest_key(session_id: str) -> str:
    """Hash: api name -> the latest response id created through it."""
    return f"{PREFIX}:{{{session_id}}}:latest"


def finished_key(session_id: str) -> str:
    """String: set (with the session's expiry) in the transaction that finishes the session, so
    the node-writing script refuses a late turn with one EXISTS instead of decoding the record."""
    return f"{PREFIX}:{{{session_id}}}:finished"


def engine_key(session_id: str) -> str:
    """String: the engine the session moved to after a failover (overrides the record's ``engine``)."""
    return f"{PREFIX}:{{{session_id}}}:engine"


def idempotency_key(session_id: str) -> str:
    """Hash: client idempotency key -> "<request fingerprint> <response id>"."""
    return f"{PREFIX}:{{{session_id}}}:idempotency"


def teacher_key(session_id: str) -> str:
    """Hash: response id -> packed teacher pass (``codec.encode_scores``) of the trajectory ending there."""
    return f"{PREFIX}:{{{session_id}}}:teacher"


def images_key(session_id: str) -> str:
    """Hash: sha256 (hex) of an image's bytes -> the packed image (``codec.encode_image``)."""
    return f"{PREFIX}:{{{session_id}}}:images"


def image_bytes_key(session_id: str) -> str:
    """String: the bytes of the session's images, summed (its bound is checked against it)."""
    return f"{PREFIX}:{{{session_id}}}:image_bytes"


def session_keys(session_id: str) -> list[str]:
    """Every key of a session, in the order the node-writing script takes them."""
    return [
        session_key(session_id),
        nodes_key(session_id),
        parents_key(session_id),
        paths_key(session_id),
        latest_key(session_id),
        routing_key(session_id),
        finished_key(session_id),
        idempotency_key(session_id),
        engine_key(session_id),
        images_key(session_id),
        image_bytes_key(session_id),
    ]


# The session listing's index: one for every proxy sharing this Redis (they share the sessions),
# in a slot of its own ("{sessions}"), so the index script's three keys stay together on a cluster.


def session_index_key() -> str:
    """Sorted set: session id, scored by its creation time (seconds): the listing's order."""
    return f"{PREFIX}:{{sessions}}:by_created"


def session_expiry_key() -> str:
    """Sorted set: session id, scored by its expiry time (seconds): what to drop from the index, and when."""
    return f"{PREFIX}:{{sessions}}:by_expiry"


def session_summary_key() -> str:
    """Hash: session id -> its listing summary (JSON), written at create and at finish."""
    return f"{PREFIX}:{{sessions}}:summaries"


def session_index_keys() -> list[str]:
    """The index's keys, in the order its scripts take them."""
    return [session_index_key(), session_expiry_key(), session_summary_key()]


def request_leases_key(limit_key: str) -> str:
    """Sorted set: lease id -> its expiry (ms, Redis's clock): the requests in flight under one shared
    bound (a job's request_concurrency), for every worker and proxy sharing this Redis; a slot of its own."""
    return f"{PREFIX}:{{limit:{limit_key}}}:leases"


def fleet_state_key() -> str:
    """String: the engine fleet's shared state (JSON: paused, policy version, engines added and removed),
    followed by every worker and proxy sharing this Redis; a slot of its own."""
    return f"{PREFIX}:{{fleet}}:state"


def feed_stream_key(stream: str) -> str:
    """Stream: the trainer feed's graded groups (field "data": JSON)."""
    return f"{PREFIX}:{{feed:{stream}}}:stream"


def feed_published_key(stream: str) -> str:
    """Hash: group id -> stream entry id, so a group is published once."""
    return f"{PREFIX}:{{feed:{stream}}}:published"
