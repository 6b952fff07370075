"""A Responses ``input`` already checked: a harness that keeps no state on the server resends it whole.

Codex CLI sends ``store: false`` and no ``previous_response_id``: every turn's ``input`` is the whole
history again (its 17.7k-character developer prompt first), plus what the turn adds. Checking an item
(the JSON limits, its exact shape, its normal form, the key it is hashed by) would cost the same on
every turn that resends it, as a resent Chat Completions history would (``proxy.known_messages``). So
per session the last input is kept, checked: its JSON as orjson writes it, the items as parsed, the
messages they fold into (``wire.responses.InputFold``) and those messages' keys. A turn whose input
begins with that JSON byte for byte (one C call to write the list, one compare) checks, folds and keys
only the items after it; anything else is checked whole, as before. Bounded per process (least recently
used sessions out first); a miss is only slower.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_proxy.proxy.limits import load_json_object
from rollout_proxy.tokenization.messages import canonical_key
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
        self._inputs: OrderedDict[str, KnownInput] = OrderedDict()
        self._max_sessions, self._max_bytes = max_sessions, max_bytes
        self._bytes = 0
        self.resent = 0  # inputs whose earlier items were reused

    def __len__(self) -> int:
        return len(self._inputs)

    def last(self, session_id: str) -> KnownInput | None:
        found = self._inputs.get(session_id)
        if found is not None:
            self._inputs.move_to_end(session_id)
        return found

    def remember(self, session_id: str, known: KnownInput) -> None:
        old = self._inputs.pop(session_id, None)
        if old is not None:
            self._bytes -= old.size
        if known.size > self._max_bytes:
            return
        self._inputs[session_id] = known
        self._bytes += known.size
        while len(self._inputs) > self._max_sessions or self._bytes > self._max_bytes:
            _, dropped = self._inputs.popitem(last=False)
            self._bytes -= dropped.size


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

    def load(self, body: bytes, *, session_id: str | None = None) -> dict[str, Any]:
        """The body as a JSON object (parsed whole: orjson's parse is not what grows with the history)."""
        return load_json_object(body)

    def look_up(self, items: Any, *, session_id: str | None = None) -> tuple[int, ...] | None:
        """The indices of ``items`` still to check; None when ``input`` is not a list (checked as ever)."""
        if type(items) is not list or session_id is None:
            return None
        self._session_id = session_id
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
            self._known.remember(self._session_id, KnownInput(self._encoded, list(items), fold, keys))
        return list(fold.messages), keys


def _encoded(items: list[Any]) -> bytes | None:
    try:
        return orjson.dumps(items)
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
