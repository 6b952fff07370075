"""A cache bounded in entries and in bytes, whose entries also leave when their time is up.

The proxy's per-session memories (a session's last conversation, its verified token, the messages
it sent, the path a worker holds for it) are worth keeping only while some session can still use
them. Each entry carries that time (its session's expiry, or the latest of the sessions sharing
it, or its last use plus an idle allowance) and ``expire`` drops the entries whose time is up:
a heap of (time, key) is popped while its head is due, so a sweep costs the entries that go, never
a scan of the others (an entry whose time moved on is skipped when its old time is popped; the heap
is rebuilt when such leftovers outnumber the entries). Before its time an entry may still go to
keep the cache within ``max_entries`` and ``max_bytes``, least recently used first: for a cache,
a miss is only slower.

Sizes are the caller's estimate of what an entry keeps alive; ``tests`` hold each estimate to what
``tracemalloc`` measures.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: What the cache itself spends per entry: its OrderedDict slot and node, the entry, a heap tuple.
ENTRY_OVERHEAD = 240


class _Entry(Generic[V]):
    __slots__ = ("size", "until", "value")

    def __init__(self, value: V, size: int, until: float) -> None:
        self.value, self.size, self.until = value, size, until


class BoundedCache(Generic[K, V]):
    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.bytes = 0  # the sizes of the entries held, ``ENTRY_OVERHEAD`` each included
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()
        self._due: list[tuple[float, Any]] = []  # a heap of (until, key)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def values(self) -> Iterator[V]:
        """The values held, least recently used first (nothing marked used)."""
        return (entry.value for entry in self._entries.values())

    def get(self, key: K, *, until: float = 0.0) -> V | None:
        """The value, marked used now and kept at least ``until``; None if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        if until > entry.until:
            entry.until = until
            self._schedule(until, key)
        return entry.value

    def put(self, key: K, value: V, *, size: int, until: float) -> bool:
        """Hold ``value`` until ``until`` (replacing the key's value and time); False when ``size`` alone
        exceeds the byte bound (nothing is held then, and the old value is gone too)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        size += ENTRY_OVERHEAD
        if size > self.max_bytes:
            return False
        self._entries[key] = _Entry(value, size, until)
        self.bytes += size
        if old is None or until != old.until:  # an equal time is scheduled already
            self._schedule(until, key)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= self._entries.popitem(last=False)[1].size
        return True

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry.size
        return entry.value

    def expire(self, now: float) -> int:
        """Drop the entries whose time is up (only they are looked at); how many went."""
        dropped = 0
        due = self._due
        while due and due[0][0] <= now:
            _, key = heapq.heappop(due)
            entry = self._entries.get(key)
            if entry is not None and entry.until <= now:
                del self._entries[key]
                self.bytes -= entry.size
                dropped += 1
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self._due.clear()
        self.bytes = 0

    def _schedule(self, until: float, key: K) -> None:
        heapq.heappush(self._due, (until, key))
        if len(self._due) > 2 * len(self._entries) + 64:  # leftovers of moved or dropped entries: rebuilt
            self._due = [(entry.until, held) for held, entry in self._entries.items()]
            heapq.heapify(self._due)
