"""Messages already checked: a conversation resends its whole history on every Chat Completions turn.

Checking a message (the JSON limits, its exact shape, its normal form and the key it is hashed
by) costs the same on every turn that resends it, so turn 100 of an agent would cost 100 times
turn 1's checks. Two memories spare that, both bounded in entries and bytes (least recently used
out first) and per session (``bounded.BoundedCache``: what only expired sessions used goes, and a
session's conversations go when it finishes; docs/operations/memory.md):

- per session, the last few conversations it sent (``session_conversations``: a harness's main
  conversation, its subagents and side calls interleave), with their normal forms and path hashes: a
  turn that resends one of those histories (its JSON byte for byte, as orjson writes it: one C call and
  one compare, so ``1`` and ``1.0`` and ``true`` never pass for each other; the longest such one) reuses
  all of it and works only on what it adds;
- per message, by its JSON as sent (orjson bytes), the normal form and canonical key of every
  message that passed: a message seen before in any session (a group's shared prompt, a history
  rewritten past its start, another worker's earlier turns) is not checked again.

Each check is about one message alone (its shape, its strings, its depth at ``messages[i]``), so a
message that passed once passes anywhere in a list. A miss is only slower.

The body is not parsed whole again either (``MessageIntake.load``): where its ``"messages":`` goes
on with one of the session's conversations byte for byte (as the openai SDK sends it: compact JSON, as
orjson writes it), only what is around that is parsed, the messages in it being those parsed for
that conversation. Parsing a 100-turn history was the largest cost that grew with the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from rollout_proxy.bounded import BoundedCache
from rollout_proxy.proxy.limits import load_json_object
from rollout_proxy.proxy.session_conversations import SessionConversations
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, canonical_key, extend_path_hash_by_key
from rollout_proxy.wire.json_bytes import right_sized, value_at
from rollout_proxy.wire.messages import normalize_message

#: the message memo: messages (of any session) that passed, by their JSON as sent
MAX_ENTRIES = 100_000
MAX_BYTES = 32 * 1024 * 1024
#: the last few conversations of each session (``session_conversations.PER_SESSION``)
MAX_SESSIONS = 8_192
MAX_CONVERSATION_BYTES = 128 * 1024 * 1024
#: rolling path hashes, by (parent hash, message key): each about ``_CHAIN_SIZE`` bytes
MAX_CHAIN_BYTES = 16 * 1024 * 1024
_CHAIN_SIZE = 200


@dataclass(frozen=True, slots=True)
class Known:
    normalized: dict[str, Any]  # shared by every request that sends this message: never changed in place
    key: bytes  # ``canonical_key(normalized)``: what the path hash chains


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation a session sent, checked: the messages as parsed, their normal forms and path hashes."""

    encoded: bytes  # the messages as orjson writes them
    count: int
    known: list[Known]
    hashes: list[str]
    messages: list[Any]  # as parsed (kept as sent): the next body that resends them reuses them
    normalized: list[dict[str, Any]]  # each of ``known``'s normal form

    @property
    def size(self) -> int:
        """About what this keeps alive: the JSON, the messages as parsed and their normal forms (each about
        the JSON's length in strings, plus a dict per message), the path hashes and the lists."""
        return 3 * len(self.encoded) + 700 * self.count + 200


class KnownMessages:
    """The app's memory of checked messages (one per process: each worker has its own).

    Bounded in entries and bytes, and per session: a session's conversations are forgotten when it
    finishes (``forget``) and, like the messages and path hashes only its sessions sent, once the last
    session that sent it has expired (``expire``, on the app's timer). Every entry keeps the latest
    expiry of the sessions that used it."""

    def __init__(
        self,
        *,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
        max_sessions: int = MAX_SESSIONS,
        max_conversation_bytes: int = MAX_CONVERSATION_BYTES,
        max_chain_bytes: int = MAX_CHAIN_BYTES,
    ) -> None:
        self._entries: BoundedCache[bytes, Known] = BoundedCache(max_entries=max_entries, max_bytes=max_bytes)
        self._conversations: SessionConversations[str, Conversation] = SessionConversations(
            max_sessions=max_sessions, max_bytes=max_conversation_bytes
        )
        # (parent path hash, key) -> path hash: the same string objects come back every turn, so a lookup
        # costs two cached hashes
        self._chain: BoundedCache[tuple[str, bytes], str] = BoundedCache(
            max_entries=max_entries, max_bytes=max_chain_bytes
        )
        self.hits = self.misses = 0
        self.resent_bodies = 0  # bodies parsed only past a conversation of the session's (``MessageIntake.load``)
        #: messages taken in past the conversation their list resends (normalized, or found in the memo): a
        #: turn that goes on from a kept conversation adds only its new messages
        self.fresh_messages = 0

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> dict[str, int]:
        """Entries and estimated bytes of each memory (what the memory docs and the soak benchmark report)."""
        return {
            "conversations": self._conversations.count(),
            "conversation_bytes": self._conversations.bytes,
            "messages": len(self._entries),
            "message_bytes": self._entries.bytes,
            "path_hashes": len(self._chain),
            "path_hash_bytes": self._chain.bytes,
        }

    def get(self, raw: bytes, *, until: float = 0.0) -> Known | None:
        return self._entries.get(raw, until=until)

    def put(self, raw: bytes, known: Known, *, until: float = 0.0) -> None:
        if raw not in self._entries:  # kept: in a buffer of its own size (orjson's is far larger)
            self._entries.put(right_sized(raw), known, size=_entry_size(raw, known), until=until)

    def path_hash(self, parent: str, key: bytes, *, until: float = 0.0) -> str:
        """``extend_path_hash_by_key``, remembered."""
        found = self._chain.get((parent, key), until=until)
        if found is None:
            found = extend_path_hash_by_key(parent, key)
            self._chain.put((parent, key), found, size=_CHAIN_SIZE, until=until)
        return found

    def conversations(self, session_id: str) -> tuple[Conversation, ...]:
        """The session's conversations, the one used last first."""
        return self._conversations.of(session_id)

    def last(self, session_id: str) -> Conversation | None:
        """The conversation the session sent last."""
        kept = self._conversations.of(session_id)
        return kept[0] if kept else None

    def remember(
        self, session_id: str, conversation: Conversation, *, resent: Conversation | None = None, until: float = 0.0
    ) -> None:
        """``conversation`` as the session's last, in the place of ``resent`` (the conversation it resends and
        goes on with), else beside the others; kept at most ``until`` (the session's expiry)."""
        self._conversations.keep(session_id, conversation, resent=resent, replace=True, until=until)

    def forget(self, session_id: str) -> None:
        """The session's conversations, once it has finished (no turn will resend them)."""
        self._conversations.forget(session_id)

    def expire(self, now: float) -> int:
        """Drop what only sessions expired by ``now`` used; how many entries went."""
        return self._conversations.expire(now) + self._entries.expire(now) + self._chain.expire(now)


class MessageIntake:
    """One request's messages against the app's ``KnownMessages``: which need checking, then the normal
    forms and path hashes of all of them (only the new ones computed, and remembered once they passed)."""

    key = "messages"  # the body's list it takes in

    def __init__(self, known: KnownMessages) -> None:
        self._known = known
        self._resent: tuple[list[Any], Conversation] | None = None  # what ``load`` spliced: (messages, from)
        self._session_id: str | None = None
        self._until = 0.0  # the session's expiry: what this request remembers is kept no longer
        self._encoded: bytes | None = None
        self._reused = 0  # leading messages equal to the conversation they resend (``_last``)
        self._last: Conversation | None = None
        self._added_raw: list[bytes | None] = []  # the JSON of each message after the reused ones
        self._added_found: list[Known | None] = []  # ... and what the app knew of it

    def load(self, body: bytes, *, session_id: str | None = None) -> dict[str, Any]:
        """The body as a JSON object (``limits.load_json_object``), the history it resends not parsed again:
        when its top-level ``"messages":`` goes on with one of the session's conversations' JSON byte for
        byte (the longest) and then ``,`` or ``]``, those messages are the ones parsed then (the same JSON
        parses to the same values) and only the rest is parsed. Anything else is parsed whole, so a bad body
        is refused in the same words."""
        for last in _longest_first(() if session_id is None else self._known.conversations(session_id)):
            payload = _after_resent(body, last)
            if payload is not None:
                self._resent = (payload["messages"], last)
                self._known.resent_bodies += 1
                return payload
        return load_json_object(body)

    def look_up(
        self, messages: Any, *, session_id: str | None = None, expires_at: float = 0.0
    ) -> tuple[int, ...] | None:
        """The indices of ``messages`` still to check (the limits walk and the shape check skip the others);
        None when ``messages`` is not a list (checked as ever). Nothing here walks the history it reuses.
        ``expires_at``: the session's expiry, after which nothing this request remembers is kept for it."""
        if type(messages) is not list:
            return None
        resent = self._resent
        kept = () if session_id is None else self._known.conversations(session_id)
        if resent is not None and resent[0] is messages and any(each is resent[1] for each in kept):
            self._last = resent[1]  # ``load`` matched its JSON already: no need to write it again
            reused = resent[1].count
            self._added_raw = [_raw(message) for message in messages[reused:]]
            self._encoded = _extended(resent[1].encoded, self._added_raw)
        else:
            encoded = _raw(messages)
            self._encoded = None if encoded is None else right_sized(encoded)  # it may be kept
            self._last, reused = None, 0
            if self._encoded is not None:
                for last in _longest_first(kept):
                    reused = _resent(self._encoded, len(messages), last)
                    if reused:
                        self._last = last
                        break
            self._added_raw = [_raw(message) for message in messages[reused:]]
        self._session_id, self._reused, self._until = session_id, reused, expires_at
        get = self._known.get
        self._added_found = [None if raw is None else get(raw, until=expires_at) for raw in self._added_raw]
        unknown = tuple(reused + at for at, found in enumerate(self._added_found) if found is None)
        self._known.hits += len(messages) - len(unknown)
        self._known.misses += len(unknown)
        return unknown

    def normalize_and_hash(self, messages: list[Any]) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
        """The normal form of each message and the rolling path hashes (as ``path_hashes``), ``messages``
        being the list ``look_up`` was given, checked since (``WireFormatError`` for a bad one)."""
        if self._reused + len(self._added_found) != len(messages):  # not looked up: everything is new
            self._added_found, self._added_raw = [None] * len(messages), [None] * len(messages)
            self._reused, self._last = 0, None
        reused, last = self._reused, self._last
        self._known.fresh_messages += len(messages) - reused
        found_all: list[Known] = [] if last is None else last.known[:reused]
        normalized: list[dict[str, Any]] = [] if last is None else last.normalized[:reused]
        hashes = [] if last is None else last.hashes[:reused]
        current = hashes[-1] if hashes else EMPTY_PATH_HASH
        chain, until = self._known.path_hash, self._until
        new: list[tuple[bytes, Known]] = []
        for index, found, raw in zip(range(reused, len(messages)), self._added_found, self._added_raw, strict=True):
            if found is None:
                form = normalize_message(messages[index], param=f"messages[{index}]")
                found = Known(form, right_sized(canonical_key(form)))
                if raw is not None:
                    new.append((raw, found))
            found_all.append(found)
            normalized.append(found.normalized)
            current = chain(current, found.key, until=until)
            hashes.append(current)
        for raw, found in new:  # every message passed: remember the new ones
            self._known.put(raw, found, until=until)
        if self._session_id is not None and self._encoded is not None:
            conversation = Conversation(self._encoded, len(messages), found_all, hashes, list(messages), normalized)
            self._known.remember(self._session_id, conversation, resent=last, until=until)
        return list(normalized), tuple(hashes)


def _entry_size(raw: bytes, known: Known) -> int:
    """About what an entry keeps alive: its JSON (as sent), the normal form's strings (about as long) and
    dict, its key, and the objects around them."""
    return 2 * len(raw) + len(known.key) + 400


def _longest_first(kept: tuple[Conversation, ...]) -> list[Conversation]:
    """The conversations a list may resend, the longest first: of two that it resends (one goes on with
    the other), the longer spares more."""
    return sorted((each for each in kept if each.count), key=lambda each: len(each.encoded), reverse=True)


def _resent(encoded: bytes, count: int, last: Conversation) -> int:
    """``last.count`` when the messages ``encoded`` begin with exactly ``last``'s (byte for byte), else 0."""
    if not last.count or count < last.count:
        return 0
    before = last.encoded[:-1]  # without its closing bracket
    follows = encoded[len(before) : len(before) + 1]
    if encoded.startswith(before) and follows == (b"]" if count == last.count else b","):
        return last.count
    return 0


_KEY = b'"messages":'
_JSON_SPACE = b" \t\n\r"  # what JSON calls whitespace (bytes.strip() would take \x0b and \x0c too)
#: the added messages are parsed under a key no body spells except as ``\u0000`` (checked absent)
_SPLICE = b'{"\\u0000":['


def _after_resent(body: bytes, last: Conversation) -> dict[str, Any] | None:
    """``body`` parsed, when its top-level ``"messages":`` is followed by ``last``'s messages (their JSON
    without the closing bracket) and then ``,`` or ``]``; else None (parse it whole).

    Three small parses instead of one large: the members before the key (``{...,`` closed with ``}``,
    which parses only if the key stands at the top level), the members after, with the added messages
    under a placeholder key, and nothing of the history. A key sent twice (``messages`` too, however
    spelled) ends as in a whole parse: the last value, at the first one's place."""
    before_bracket = last.encoded[:-1]
    start = value_at(body, _KEY, before_bracket)
    if start < 0:
        return None
    at, end = start - len(_KEY), start + len(before_bracket)
    follows = body[end : end + 1]
    if follows == b",":
        rest = body[end + 1 :]
    elif follows == b"]":
        rest = body[end:]
    else:  # the last message goes on (or whitespace): not the same JSON
        return None
    head = body[:at]
    if b"\\u0000" in rest:
        return None
    try:
        if head.strip(_JSON_SPACE) == b"{":
            before: Any = {}
        elif head.endswith(b","):
            before = orjson.loads(head[:-1] + b"}")
            if type(before) is not dict or not before:  # not at the top level, or "{," (no JSON)
                return None
        else:
            return None
        after = orjson.loads(_SPLICE + rest)
    except orjson.JSONDecodeError:
        return None  # the whole parse words the error
    if type(after) is not dict:
        return None
    added = after.pop("\x00")
    if type(added) is not list or (follows == b"," and not added):  # "[...,]" is no JSON
        return None
    before["messages"] = last.messages + added
    before.update(after)  # a key sent twice keeps its first place and its last value, as orjson parses it
    return before


def _extended(encoded: bytes, added: list[bytes | None]) -> bytes | None:
    """What orjson writes for a list written ``encoded`` plus the items written ``added`` (None: unknown)."""
    if not added:
        return encoded
    if any(raw is None for raw in added):
        return None
    return b"".join((encoded[:-1], b",", b",".join(added), b"]"))  # type: ignore[arg-type]


def _raw(message: Any) -> bytes | None:
    if type(message) not in (dict, list):
        return None
    try:
        return orjson.dumps(message)
    except (orjson.JSONEncodeError, TypeError):  # e.g. an integer past 64 bits: checked the slow way
        return None
