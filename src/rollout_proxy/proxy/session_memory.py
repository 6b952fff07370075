"""What the app keeps per session, dropped once the session has expired; and the freed memory given back.

The app remembers, per session, its last few lists of each API and the items it sent
(``resent_history``), the image URLs it fetched (``images``), its verified token (``auth``) and its place in the open-session gauge (``metrics``); a finish drops the conversations
at once, and a timer (``sweep_forever``, each ``SWEEP_EVERY`` seconds) drops what only expired sessions
used, with or without traffic. The stores drop the sessions themselves (the memory store on its own
timer, Redis by key expiry).

Freed memory stays in the process: glibc keeps the chunks in its heaps for the next allocations
(under a steady load that is what keeps RSS flat), so RSS does not fall when a load stops. Once
everything this app kept for sessions has gone and nothing new came for ``QUIET_BEFORE_RELEASE``
seconds, ``release_free_memory`` runs a full collection and ``malloc_trim(0)`` once, in a thread
(it takes 5-20 ms on a proxy that served a few hundred sessions): the free pages go back to the
system. Measured in docs/operations/memory.md.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import time
from collections.abc import Callable

import structlog
from aiohttp import web

from rollout_proxy.proxy import keys

log = structlog.get_logger(__name__)

#: Seconds between sweeps: how long an expired session's entries may outlive it.
SWEEP_EVERY = 1.0
#: Seconds with nothing kept for any session before the free memory is given back (once).
QUIET_BEFORE_RELEASE = 5.0


def expire(app: web.Application, now: float) -> int:
    """Drop what the app keeps for sessions expired by ``now``; how many entries went."""
    dropped = app[keys.RESENT_HISTORY].expire(now) + app[keys.TOKENS].expire(now) + app[keys.IMAGES].expire(now)
    app[keys.METRICS].sessions.count(now)
    return dropped


def held(app: web.Application) -> int:
    """Entries the app keeps for sessions (lists, items, path hashes, tokens, open sessions)."""
    known = app[keys.RESENT_HISTORY].held()
    entries = known["conversations"] + known["messages"] + known["path_hashes"]
    return entries + len(app[keys.TOKENS]) + len(app[keys.IMAGES]) + app[keys.METRICS].sessions.count(time.time())


def release_free_memory() -> bool:
    """A full collection, then glibc's free heap pages handed back to the system; False where the C library
    has no ``malloc_trim`` (musl, macOS): there the collection alone."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim(0)
    return True


async def sweep_forever(
    app: web.Application,
    *,
    every: float = SWEEP_EVERY,
    quiet: float = QUIET_BEFORE_RELEASE,
    release: Callable[[], bool] = release_free_memory,
    clock: Callable[[], float] = time.time,
) -> None:
    """Each ``every`` seconds, ``expire``; once nothing has been kept for ``quiet`` seconds after some of it
    went, ``release`` (in a thread), and again only after more has come and gone."""
    released, empty_since = True, None
    while True:
        await asyncio.sleep(every)
        now = clock()
        if expire(app, now):
            released = False
        if held(app):
            empty_since = None
            continue
        empty_since = now if empty_since is None else empty_since
        if not released and now - empty_since >= quiet:
            released = True
            trimmed = await asyncio.to_thread(release)
            log.info("session_memory_released", malloc_trim=trimmed)
