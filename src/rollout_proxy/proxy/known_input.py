"""A resent list of items already checked and folded: Responses' ``input``, the Messages API's ``messages``.

Codex CLI sends ``store: false`` and no ``previous_response_id``: every turn's ``input`` is the whole
history again (its 17.7k-character developer prompt first), plus what the turn adds; Claude Code resends
its whole ``messages`` every turn too. Checking an item (the JSON limits, its exact shape) and folding it
into the normal form would cost the same on every turn that resends it, as a resent Chat Completions
history would (``proxy.known_messages``). So per session and API the last list is kept, checked: its
JSON as orjson writes it, the items as parsed, the ``Fold`` they made (``wire.responses.InputFold``,
``wire.anthropic.Conversation``) and the messages' keys. A turn whose list begins with that JSON byte
for byte (one C call to write the list, one compare) checks, folds and keys only the items after it,
when what else the fold depends on (the Messages API's ``system``: the ``context``) is the same;
anything else is checked and folded whole, as before. Bounded per process in entries and bytes (least
recently used out first), kept until its session's expiry at most and forgotten at its finish
(``proxy.session_memory``); a miss is only slower.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson

from rollout_proxy.bounded import BoundedCache
from rollout_proxy.proxy.limits import load_json_object
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
    """A session's last list, checked and folded."""

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
    """The app's memory of each session's last list, per API (one per process)."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, max_bytes: int = MAX_BYTES) -> None:
        self._inputs: BoundedCache[tuple[str, str], KnownInput] = BoundedCache(
            max_entries=max_sessions, max_bytes=max_bytes
        )
        self.resent = 0  # lists whose earlier items were reused

    def __len__(self) -> int:
        return len(self._inputs)

    @property
    def bytes(self) -> int:
        return self._inputs.bytes

    def last(self, api: str, session_id: str) -> KnownInput | None:
        return self._inputs.get((api, session_id))

    def remember(self, api: str, session_id: str, known: KnownInput, *, until: float = 0.0) -> None:
        """``known`` as the session's last list of ``api``, kept at most ``until`` (the session's expiry)."""
        self._inputs.put((api, session_id), known, size=known.size, until=until)

    def forget(self, session_id: str) -> None:
        """The session's lists, once it has finished (no turn will resend them)."""
        for api in APIS:
            self._inputs.pop((api, session_id))

    def expire(self, now: float) -> int:
        """Drop the lists of sessions expired by ``now``; how many went."""
        return self._inputs.expire(now)


class ListIntake:
    """One request's list (``key``) against the app's ``KnownInputs``: which items need checking
    (``look_up``), then the fold and keys of all of them, only the new items folded and keyed (``fold``).

    Reused are the leading items equal (their JSON, byte for byte) to the last list's: all of it when the
    list resends it whole, the start of it when an earlier item changed (Claude Code moves its
    ``cache_control`` marks to the newest message each turn), as far as the fold can go on from there."""

    def __init__(self, known: KnownInputs, *, api: str, key: str) -> None:
        self.key = key  # the body's list it takes in
        self._known, self._api = known, api
        self._session_id: str | None = None
        self._raws: list[bytes] | None = None
        self._last: KnownInput | None = None
        self._reused = 0
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
        self._raws = _encoded_items(items)
        last = self._known.last(self._api, session_id)
        reused = 0 if last is None or self._raws is None else _same_start(self._raws, last)
        self._last, self._reused = (last, reused) if reused else (None, 0)
        return tuple(range(reused, len(items)))

    def fold(
        self, items: list[Any], start: Callable[[], F], *, context: bytes = b"", param: str | None = None
    ) -> tuple[F, list[bytes]]:
        """The fold of ``items`` (checked since ``look_up``) and its messages' keys: the remembered fold (or
        its start) extended by the items after those reused, when ``context`` is the same, else ``start()``
        and every item. Remembered for the session's next turn."""
        where = param or self.key
        last, reused = self._last, self._reused
        base = None
        if last is not None and reused and last.context == context:
            count = last.ends[reused - 1]
            base = last.fold.extended() if reused == len(last.items) else last.fold.upto(count)
        if base is None:
            reused = 0
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
        if self._session_id is not None and self._raws is not None:
            encoded = right_sized(b"[" + b",".join(self._raws) + b"]")
            lengths = [len(raw) for raw in self._raws]
            known = KnownInput(encoded, lengths, list(items), fold, ends, message_keys, context)
            self._known.remember(self._api, self._session_id, known, until=self._until)
        return fold, message_keys


def _encoded_items(items: list[Any]) -> list[bytes] | None:
    """Each item as orjson writes it (the list's JSON is them joined by commas, in brackets)."""
    try:
        return [orjson.dumps(item) for item in items]
    except (orjson.JSONEncodeError, TypeError):  # e.g. an integer past 64 bits: checked the slow way
        return None


def _same_start(raws: list[bytes], last: KnownInput) -> int:
    """How many leading items are byte for byte the last list's."""
    position, encoded = 1, last.encoded  # past its opening bracket
    same = 0
    for raw, length in zip(raws, last.lengths, strict=False):
        if length != len(raw) or encoded[position : position + length] != raw:
            break
        same += 1
        position += length + 1  # and its comma
    return same
