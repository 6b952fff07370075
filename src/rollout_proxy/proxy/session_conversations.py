"""A few conversations per session, what the resent-history memory keeps (``resent_history``).

A harness's session is not one conversation: its subagents (another system prompt, another task), its
side calls (Claude Code's title request, a ``count_tokens``) and the main conversation interleave, each
resending its own history. A memory of only the session's last list lost the main conversation to each of
them, and the main's next turn cost its whole history again. So a session keeps up to ``PER_SESSION``
lists, the one used last first; a turn goes on from the list it resends (each memory's own rule: the
longest kept prefix of its list), and its list then takes that one's place (the conversation went on) or
joins the others (a new conversation, a side call), the least recently used going first. Bounded per
process as before: in sessions (a session's lists are one entry) and in bytes (the lists' sizes summed,
the newest kept first); forgotten whole at the session's finish, dropped at its expiry. A miss is only
slower.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from rollout_proxy.bounded import ENTRY_OVERHEAD, BoundedCache

#: lists kept per session (and API): the main conversation, a few subagents and side calls
PER_SESSION = 8


class Kept(Protocol):
    @property
    def size(self) -> int:
        """About the bytes it keeps alive."""
        ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Kept)


class SessionConversations(Generic[K, V]):
    """Each session's (``K``) last few lists (``V``), the one used last first."""

    def __init__(self, *, max_sessions: int, max_bytes: int, per_session: int = PER_SESSION) -> None:
        self._cache: BoundedCache[K, tuple[V, ...]] = BoundedCache(max_entries=max_sessions, max_bytes=max_bytes)
        self.per_session = per_session

    def __len__(self) -> int:
        """Sessions with lists kept."""
        return len(self._cache)

    @property
    def bytes(self) -> int:
        return self._cache.bytes

    def count(self) -> int:
        """Lists kept, every session's (a walk over the sessions: for reports, not for a turn)."""
        return sum(len(kept) for kept in self._cache.values())

    def of(self, key: K) -> tuple[V, ...]:
        """The session's lists, the one used last first (the session marked used)."""
        return self._cache.get(key) or ()

    def keep(self, key: K, kept: V, *, resent: V | None = None, replace: bool = False, until: float = 0.0) -> None:
        """``kept`` as the session's newest list; ``resent``, the kept list it resends (or the start of it),
        goes: ``replace``d by it (the conversation went on), else next to it (used now). The session's least
        recently used lists go past ``per_session`` or the byte bound. Kept at most ``until`` (the
        session's expiry)."""
        before = self._cache.get(key) or ()
        others = [each for each in before if each is not resent]
        if resent is not None and not replace and len(others) < len(before):
            others.insert(0, resent)
        fitting: list[V] = []
        size = 0
        for each in [kept, *others]:
            if len(fitting) == self.per_session:
                break
            if size + each.size + ENTRY_OVERHEAD <= self._cache.max_bytes:  # one too large alone is left out
                fitting.append(each)
                size += each.size
        if fitting:
            self._cache.put(key, tuple(fitting), size=size, until=until)
        else:
            self._cache.pop(key)

    def forget(self, key: K) -> None:
        """All the session's lists (it has finished: no turn will resend them)."""
        self._cache.pop(key)

    def expire(self, now: float) -> int:
        """Drop the lists of sessions expired by ``now``; how many sessions went."""
        return self._cache.expire(now)
