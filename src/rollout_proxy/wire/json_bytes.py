"""Compact JSON read as bytes, where looking is cheaper than parsing; and JSON bytes kept at their own size."""

from __future__ import annotations


def value_at(body: bytes, key: bytes, value: bytes) -> int:
    """Where ``value`` starts right after the first ``key`` (``b'"messages":'``) it follows in ``body``; -1 if
    it follows none. The short key is searched and the value compared once where each one stands:
    ``bytes.find`` with key and value as one long needle costs a few µs per KiB of needle (a whole prompt,
    a whole history), where this costs about what the compare does."""
    at = body.find(key)
    while at >= 0:
        start = at + len(key)
        if body.startswith(value, start):
            return start
        at = body.find(key, start)
    return -1


def right_sized(encoded: bytes) -> bytes:
    """``encoded`` in an allocation of its own length, for JSON bytes that are kept (a memo's key, a
    remembered history, a cache key).

    orjson (3.12 on) hands back its output in the buffer it wrote into: a 60-byte message holds 4 KiB,
    a 5 KiB list 16 KiB (``sys.getsizeof`` shows the length; the allocator, and ``tracemalloc``, the
    buffer). A cache of a hundred thousand such keys held 400 MB where it counted 20. The copy costs
    ~0.1 µs for a message."""
    return bytes(memoryview(encoded))
