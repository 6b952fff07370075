"""A Responses ``input`` already checked: a harness that keeps no state on the server resends it whole.

Codex CLI sends ``store: false`` and no ``previous_response_id``: every turn's ``input`` is the whole
history again (its 17.7k-character developer prompt first), plus what the turn adds. Checking an item
(the JSON limits, its exact shape, its normal form, the key it is hashed by) would cost the same on
every turn that resends it, as a resent Chat Completions history would (``proxy.known_messages``). So
per session the last input is kept, checked: its JSON as orjson writes it, the items as parsed, the
messages they fold into (``wire.responses.InputFold``) and those messages' keys. A turn whose input
begins with that JSON byte for byte (one C call to write the list, one compare) checks, folds and keys
only the items after it; anything else is checked whole, as before. Bounded per process in entries and
bytes (least recently used sessions out first), kept until its session's expiry at most and forgotten at
its finish (``proxy.session_memory``); a miss is only slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from rollout_proxy.bounded import BoundedCache
from rollout_proxy.proxy.limits import load_json_object
from rollout_proxy.tokenization.messages import canonical_key
from rollout_proxy.wire.json_bytes import right_sized
from rollout_proxy.wire.responses import InputFold

MAX_SESSIONS = 8_192
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class KnownInput:
    """A session's last input, checked."""

    encoded: bytes  # the items as orjson writes them
    items: list[Any]  # as parsed (kept as sent)
    fold: InputFold  # the messages they fold into (never changed in place: ``InputFold.extended``)
    keys: list[bytes]  # ``canonical_key`` of each of ``fold.messages``

    @property
    def size(self) -> int:
        """About what this keeps alive: the JSON, the items as parsed (~5x their JSON) and the messages."""
        return 8 * len(self.encoded) + 200 * len(self.items)


class KnownInputs:
    """The app's memory of each session's last Responses input (one per process)."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, max_bytes: int = MAX_BYTES) -> None:
        self._inputs: BoundedCache[str, KnownInput] = BoundedCache(max_entries=max_sessions, max_bytes=max_bytes)
        self.resent = 0  # inputs whose earlier items were reused

    def __len__(self) -> int:
        return len(self._inputs)

    @property
    def bytes(self) -> int:
        return self._inputs.bytes

    def last(self, session_id: str) -> KnownInput | None:
        return self._inputs.get(session_id)

    def remember(self, session_id: str, known: KnownInput, *, until: float = 0.0) -> None:
        """``known`` as the session's last input, kept at most ``until`` (the session's expiry)."""
        self._inputs.put(session_id, known, size=known.size, until=until)

    def forget(self, session_id: str) -> None:
        """The session's input, once it has finished (no turn will resend it)."""
        self._inputs.pop(session_id)

    def expire(self, now: float) -> int:
        """Drop the inputs of sessions expired by ``now``; how many went."""
        return self._inputs.expire(now)


class InputIntake:
    """One request's ``input`` against the app's ``KnownInputs``: which items need checking, then the
    messages and keys of all of them (only the new items folded and keyed)."""

    key = "input"  # the body's list it takes in

    def __init__(self, known: KnownInputs) -> None:
        self._known = known
        self._session_id: str | None = None
        self._encoded: bytes | None = None
        self._last: KnownInput | None = None
        self._reused = 0
        self._until = 0.0  # the session's expiry: what this request remembers is kept no longer

    def load(self, body: bytes, *, session_id: str | None = None) -> dict[str, Any]:
        """The body as a JSON object (parsed whole: orjson's parse is not what grows with the history)."""
        return load_json_object(body)

    def look_up(self, items: Any, *, session_id: str | None = None, expires_at: float = 0.0) -> tuple[int, ...] | None:
        """The indices of ``items`` still to check; None when ``input`` is not a list (checked as ever).
        ``expires_at``: the session's expiry, after which nothing this request remembers is kept for it."""
        if type(items) is not list or session_id is None:
            return None
        self._session_id, self._until = session_id, expires_at
        self._encoded = _encoded(items)
        last = self._known.last(session_id)
        reused = 0 if last is None or self._encoded is None else _resent(self._encoded, len(items), last)
        self._last, self._reused = (last, reused) if reused else (None, 0)
        return tuple(range(reused, len(items)))

    def messages(self, items: Any, *, param: str = "input") -> tuple[list[dict[str, Any]], list[bytes]] | None:
        """The messages ``items`` (checked since ``look_up``) fold into, and their keys; None when ``items``
        is not a list (a string input: ``input_to_messages``). Remembered for the session's next turn."""
        if type(items) is not list:
            return None
        last, reused = self._last, self._reused
        if last is None or reused != len(last.items):
            last, reused = None, 0
        fold = InputFold() if last is None else last.fold.extended()
        settled = 0 if last is None else last.fold.settled
        for index in range(reused, len(items)):
            fold.add(items[index], f"{param}[{index}]")
        keys = [] if last is None else last.keys[:settled]
        keys += [canonical_key(message) for message in fold.messages[len(keys) :]]
        if reused:
            self._known.resent += 1
        if self._session_id is not None and self._encoded is not None:
            known = KnownInput(self._encoded, list(items), fold, [right_sized(key) for key in keys])
            self._known.remember(self._session_id, known, until=self._until)
        return list(fold.messages), keys


def _encoded(items: list[Any]) -> bytes | None:
    """The items as orjson writes them, in a buffer of their own size (it may be kept)."""
    try:
        return right_sized(orjson.dumps(items))
    except (orjson.JSONEncodeError, TypeError):  # e.g. an integer past 64 bits: checked the slow way
        return None


def _resent(encoded: bytes, count: int, last: KnownInput) -> int:
    """How many items ``last`` had when the items written ``encoded`` begin with exactly them, else 0."""
    if not last.items or count < len(last.items):
        return 0
    before = last.encoded[:-1]  # without its closing bracket
    follows = encoded[len(before) : len(before) + 1]
    if encoded.startswith(before) and follows == (b"]" if count == len(last.items) else b","):
        return len(last.items)
    return 0
