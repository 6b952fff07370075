"""A resent list of items already checked and folded: Responses' ``input``, the Messages API's ``messages``.

Codex CLI sends ``store: false`` and no ``previous_response_id``: every turn's ``input`` is the whole
history again (its 17.7k-character developer prompt first), plus what the turn adds; Claude Code resends
its whole ``messages`` every turn too. Checking an item (the JSON limits, its exact shape) and folding it
into the normal form would cost the same on every turn that resends it, as a resent Chat Completions
history would (``proxy.known_messages``). So per session and API the last few lists are kept, checked
(``proxy.session_conversations``: the main conversation, a subagent's, a side call's, interleaved): each
one's JSON as orjson writes it, the items as parsed, the ``Fold`` they made
(``wire.responses.InputFold``, ``wire.anthropic.Conversation``) and the messages' keys. A turn whose
list begins with one of those lists' JSON byte for byte (one C call to write the list, one compare per
kept list, which stops at its first item unless that is the same) checks, folds and keys only the items
after the longest such start, when what else the fold depends on (the Messages API's ``system``: the
``context``) is the same; anything else is checked and folded whole, as before. Bounded per process in
entries and bytes (least recently used out first), kept until its session's expiry at most and forgotten
at its finish (``proxy.session_memory``); a miss is only slower.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson

from rollout_proxy.proxy.limits import load_json_object
from rollout_proxy.proxy.session_conversations import SessionConversations
from rollout_proxy.tokenization.messages import canonical_key
from rollout_proxy.wire.json_bytes import right_sized

MAX_SESSIONS = 8_192
MAX_BYTES = 64 * 1024 * 1024
#: the APIs whose lists are kept (a session may use both; each keeps its own)
APIS = ("responses", "messages")


class Fold(Protocol):
    """Items folded into messages one by one, so that what a longer list adds is folded alone."""

    messages: list[dict[str, Any]]

    @property
    def settled(self) -> int:
        """How many of ``messages`` no item added later can change."""
        ...

    def extended(self) -> Any:
        """A fold that goes on from this one without changing it."""
        ...

    def upto(self, count: int) -> Any:
        """A fold of only the items that made the first ``count`` of ``messages`` (nothing changed here),
        to go on from when a list resends only the start of the last one; None where it cannot tell."""
        ...

    def add(self, item: Any, where: str) -> None: ...


F = TypeVar("F", bound=Fold)


@dataclass(frozen=True, slots=True)
class KnownInput:
    """A list a session sent, checked and folded."""

    encoded: bytes  # the items as orjson writes them (right-sized)
    lengths: list[int]  # each item's length in ``encoded``
    items: list[Any]  # as parsed (kept as sent)
    fold: Any  # the ``Fold`` they made (never changed in place: ``extended``)
    ends: list[int]  # how many of the fold's messages there were after each item
    keys: list[bytes]  # ``canonical_key`` of each of ``fold.messages``
    context: bytes  # what else the fold depends on: reused only when it is the same

    @property
    def size(self) -> int:
        """About what this keeps alive: the JSON, the items as parsed (~5x their JSON) and the messages."""
        return 8 * len(self.encoded) + 240 * len(self.items) + len(self.context)


class KnownInputs:
    """The app's memory of each session's last few lists, per API (one per process)."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, max_bytes: int = MAX_BYTES) -> None:
        self._inputs: SessionConversations[tuple[str, str], KnownInput] = SessionConversations(
            max_sessions=max_sessions, max_bytes=max_bytes
        )
        self.resent = 0  # lists whose earlier items were reused
        #: items folded past the list they resend (the checks skip at least as many): a turn that goes on
        #: from a kept list folds only its new items
        self.fresh_items = 0

    def __len__(self) -> int:
        """The lists kept, every session's and API's."""
        return self._inputs.count()

    @property
    def bytes(self) -> int:
        return self._inputs.bytes

    def lists(self, api: str, session_id: str) -> tuple[KnownInput, ...]:
        """The session's lists of ``api``, the one used last first."""
        return self._inputs.of((api, session_id))

    def last(self, api: str, session_id: str) -> KnownInput | None:
        """The list of ``api`` the session sent last."""
        kept = self._inputs.of((api, session_id))
        return kept[0] if kept else None

    def remember(
        self,
        api: str,
        session_id: str,
        known: KnownInput,
        *,
        resent: KnownInput | None = None,
        replace: bool = False,
        until: float = 0.0,
    ) -> None:
        """``known`` as the session's last list of ``api``; ``resent`` (the kept list whose start it resends)
        ``replace``d by it, else kept beside it; kept at most ``until`` (the session's expiry)."""
        self._inputs.keep((api, session_id), known, resent=resent, replace=replace, until=until)

    def forget(self, session_id: str) -> None:
        """The session's lists, once it has finished (no turn will resend them)."""
        for api in APIS:
            self._inputs.forget((api, session_id))

    def expire(self, now: float) -> int:
        """Drop the lists of sessions expired by ``now``; how many went."""
        return self._inputs.expire(now)


class ListIntake:
    """One request's list (``key``) against the app's ``KnownInputs``: which items need checking
    (``look_up``), then the fold and keys of all of them, only the new items folded and keyed (``fold``).

    Reused are the leading items equal (their JSON, byte for byte) to a kept list's, the one that shares
    the most: all of it when the list resends it whole, the start of it when an earlier item changed
    (Claude Code moves its ``cache_control`` marks to the newest message each turn), as far as the fold can
    go on from there. The list then takes the place of the kept one it shares the most with (same
    ``context``) unless it is shorter than that one (a side call that resends only its start, a retry):
    those are kept beside it."""

    def __init__(self, known: KnownInputs, *, api: str, key: str) -> None:
        self.key = key  # the body's list it takes in
        self._known, self._api = known, api
        self._session_id: str | None = None
        self._raws: list[bytes] | None = None
        self._shared: list[tuple[int, KnownInput]] = []  # (leading items the same, kept list): most first
        self._until = 0.0  # the session's expiry: what this request remembers is kept no longer

    def load(self, body: bytes, *, session_id: str | None = None) -> dict[str, Any]:
        """The body as a JSON object (parsed whole: orjson's parse is not what grows with the history)."""
        return load_json_object(body)

    def look_up(self, items: Any, *, session_id: str | None = None, expires_at: float = 0.0) -> tuple[int, ...] | None:
        """The indices of ``items`` still to check; None when the list is not a list (checked as ever).
        ``expires_at``: the session's expiry, after which nothing this request remembers is kept for it."""
        if type(items) is not list or session_id is None:
            return None
        self._session_id, self._until = session_id, expires_at
        self._raws = raws = _encoded_items(items)
        kept = () if raws is None else self._known.lists(self._api, session_id)
        shared = [] if raws is None else [(same, each) for each in kept if (same := _same_start(raws, each))]
        self._shared = sorted(shared, key=lambda pair: pair[0], reverse=True)
        return tuple(range(self._shared[0][0] if self._shared else 0, len(items)))

    def fold(
        self, items: list[Any], start: Callable[[], F], *, context: bytes = b"", param: str | None = None
    ) -> tuple[F, list[bytes]]:
        """The fold of ``items`` (checked since ``look_up``) and its messages' keys: a remembered fold (or its
        start) extended by the items after those reused, when ``context`` is the same, else ``start()`` and
        every item. Remembered for the session's next turns."""
        where = param or self.key
        alike = [(same, kept) for same, kept in self._shared if kept.context == context]
        last, reused, base = None, 0, None
        for same, kept in alike:  # the one sharing the most whose fold can go on from there
            count = kept.ends[same - 1]
            base = kept.fold.extended() if same == len(kept.items) else kept.fold.upto(count)
            if base is not None:
                last, reused = kept, same
                break
        fold: F = start() if base is None else base
        settled = 0 if base is None or last is None else min(last.ends[reused - 1], fold.settled)
        ends = [] if base is None or last is None else last.ends[:reused]
        for index in range(reused, len(items)):
            fold.add(items[index], f"{where}[{index}]")
            ends.append(len(fold.messages))
        message_keys = [] if last is None or base is None else last.keys[:settled]
        message_keys += [right_sized(canonical_key(message)) for message in fold.messages[len(message_keys) :]]
        if reused:
            self._known.resent += 1
        self._known.fresh_items += len(items) - reused
        if self._session_id is not None and self._raws is not None:
            encoded = right_sized(b"[" + b",".join(self._raws) + b"]")
            lengths = [len(raw) for raw in self._raws]
            known = KnownInput(encoded, lengths, list(items), fold, ends, message_keys, context)
            resent = alike[0][1] if alike else None  # what this list goes on from, unless it is shorter
            replace = resent is not None and len(items) >= len(resent.items)
            self._known.remember(self._api, self._session_id, known, resent=resent, replace=replace, until=self._until)
        return fold, message_keys


def _encoded_items(items: list[Any]) -> list[bytes] | None:
    """Each item as orjson writes it (the list's JSON is them joined by commas, in brackets)."""
    try:
        return [orjson.dumps(item) for item in items]
    except (orjson.JSONEncodeError, TypeError):  # e.g. an integer past 64 bits: checked the slow way
        return None


def _same_start(raws: list[bytes], kept: KnownInput) -> int:
    """How many leading items are byte for byte ``kept``'s (a list that is not one of its conversations
    differs at its first item: one length compare, or one compare that stops at the first other byte)."""
    position, encoded = 1, kept.encoded  # past its opening bracket
    same = 0
    for raw, length in zip(raws, kept.lengths, strict=False):
        if length != len(raw) or not encoded.startswith(raw, position):
            break
        same += 1
        position += length + 1  # and its comma
    return same
