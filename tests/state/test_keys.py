"""The Redis key namespace: a session's keys share one cluster slot, and no two kinds of key collide.

Redis Cluster refuses a multi-key transaction or script over keys of different slots; the slot of a
key with a ``{hash tag}`` is that of the tag alone. So every key of one session must carry the same
tag, and the shared indexes (sessions, leases, fleet, feed) tags of their own.
"""

from __future__ import annotations

import re

from rollout_proxy.state import keys

SESSION = "sess_0123456789abcdef"
OTHER = "sess_fedcba9876543210"


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes: the first non-empty ``{...}``, else the whole key."""
    match = re.search(r"\{([^}]+)\}", key)
    return match.group(1) if match else key


def test_every_key_of_a_session_is_in_the_sessions_slot():
    session_keys = [*keys.session_keys(SESSION), keys.teacher_key(SESSION)]
    assert {hash_tag(key) for key in session_keys} == {SESSION}


def test_a_sessions_keys_are_distinct_and_not_another_sessions():
    mine, theirs = keys.session_keys(SESSION), keys.session_keys(OTHER)
    assert len(set(mine)) == len(mine)
    assert keys.teacher_key(SESSION) not in mine
    assert not set(mine) & set(theirs)


def test_the_session_index_keys_share_one_slot_of_their_own():
    index = keys.session_index_keys()
    assert len(set(index)) == 3
    assert {hash_tag(key) for key in index} == {"sessions"}


def test_shared_keys_have_slots_of_their_own_per_name():
    assert hash_tag(keys.request_leases_key("job-a")) == "limit:job-a"
    assert keys.request_leases_key("job-a") != keys.request_leases_key("job-b")
    assert hash_tag(keys.fleet_state_key()) == "fleet"
    stream, published = keys.feed_stream_key("main"), keys.feed_published_key("main")
    assert stream != published and hash_tag(stream) == hash_tag(published) == "feed:main"
    assert hash_tag(keys.feed_stream_key("other")) != hash_tag(stream)


def test_every_key_is_under_the_prefix():
    every = [
        *keys.session_keys(SESSION),
        keys.teacher_key(SESSION),
        *keys.session_index_keys(),
        keys.request_leases_key("job"),
        keys.fleet_state_key(),
        keys.feed_stream_key("main"),
        keys.feed_published_key("main"),
    ]
    assert all(key.startswith(keys.PREFIX + ":") for key in every)
