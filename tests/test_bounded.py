"""``BoundedCache``: entries go when their time is up, or earlier to stay within entries and bytes."""

from __future__ import annotations

from rollout_proxy.bounded import ENTRY_OVERHEAD, BoundedCache


def test_entries_go_when_their_time_is_up_and_not_before():
    cache: BoundedCache[str, int] = BoundedCache(max_entries=100, max_bytes=1 << 20)
    for index in range(10):
        cache.put(f"k{index}", index, size=10, until=float(index))
    assert cache.expire(4.5) == 5  # k0..k4
    assert sorted(key for key in (f"k{i}" for i in range(10)) if key in cache) == [f"k{i}" for i in range(5, 10)]
    assert cache.bytes == 5 * (10 + ENTRY_OVERHEAD)
    assert cache.expire(100.0) == 5
    assert len(cache) == 0 and cache.bytes == 0


def test_a_later_use_keeps_an_entry_until_its_own_time():
    cache: BoundedCache[str, str] = BoundedCache(max_entries=100, max_bytes=1 << 20)
    cache.put("shared", "prompt", size=10, until=10.0)
    assert cache.get("shared", until=50.0) == "prompt"  # a later session uses it too
    assert cache.get("shared", until=20.0) == "prompt"  # an earlier time never shortens it
    assert cache.expire(30.0) == 0 and "shared" in cache
    assert cache.expire(50.0) == 1 and "shared" not in cache
    cache.put("again", "x", size=1, until=5.0)
    cache.put("again", "y", size=1, until=1.0)  # replaced, its time too: an earlier one counts
    assert cache.expire(2.0) == 1 and "again" not in cache


def test_bounds_push_out_the_least_recently_used_first():
    cache: BoundedCache[str, int] = BoundedCache(max_entries=3, max_bytes=1 << 20)
    for index in range(3):
        cache.put(f"k{index}", index, size=1, until=99.0)
    cache.get("k0")  # used: now the most recent
    cache.put("k3", 3, size=1, until=99.0)
    assert "k1" not in cache and all(key in cache for key in ("k0", "k2", "k3"))

    by_bytes: BoundedCache[str, int] = BoundedCache(max_entries=100, max_bytes=3 * (100 + ENTRY_OVERHEAD))
    for index in range(5):
        by_bytes.put(f"k{index}", index, size=100, until=99.0)
    assert len(by_bytes) == 3 and by_bytes.bytes <= by_bytes.max_bytes
    assert not by_bytes.put("huge", 0, size=by_bytes.max_bytes, until=99.0) and "huge" not in by_bytes


def test_what_a_sweep_keeps_stays_the_size_of_the_entries():
    """Every use that moves an entry's time on leaves its old time in the heap: it is rebuilt before those
    outnumber the entries, so a long-lived hot entry costs nothing that grows."""
    cache: BoundedCache[str, int] = BoundedCache(max_entries=100, max_bytes=1 << 20)
    for index in range(10):
        cache.put(f"k{index}", index, size=1, until=1.0)
    for step in range(10_000):
        cache.get(f"k{step % 10}", until=2.0 + step)
        assert len(cache._due) <= 2 * len(cache) + 64
    for index in range(10):
        cache.pop(f"k{index}")
    assert cache.bytes == 0 and cache.expire(1e9) == 0
