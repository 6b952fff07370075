"""A resent history taken in once: the one memory of every API's long list (chat ``messages``, Responses
``input``, the Messages API's ``messages``).

Agents resend their whole history every turn (the openai SDK's chat loop, Codex with ``store: false``,
Claude Code), so parsing, checking (the JSON limits, the item's exact shape) and normalizing it would cost
turn 100 of a conversation a hundred times turn 1's. Per session and API this keeps the last few lists it
sent (``session_conversations``: a harness's main conversation, its subagents and side calls interleave),
each as orjson writes it (``1``, ``1.0`` and ``true`` never pass for each other), with the items as parsed,
the ``Fold`` they made (``wire.messages.MessageFold``, ``wire.responses.InputFold``,
``wire.anthropic.Conversation``: items folded into normal-form messages one by one), and the messages'
keys and path hashes. A request goes on from the kept list it shares the longest start with, byte for
byte, item by item:

- **parse** (``load``): where the body's list goes on with a kept list's JSON byte for byte (as SDKs send
  it: compact JSON), only what is around that is parsed, the items in it being the kept list's;
- **check** (``look_up``): only the items past that start, and of those only the ones no session sent
  before (the item memo, by API and JSON: each check is about one item alone, so one that passed passes
  anywhere in a list of that API);
- **fold** (``take``): only the items past that start, on a copy of the kept fold (or of its start, where
  the fold can tell: Claude Code moves its ``cache_control`` marks to the newest message each turn, so its
  list shares all but the last turn's items), when what else the fold depends on (the Messages API's
  ``system``: its ``context``) is the same;
- **split the tools** (``tool_set``): a harness sends the same tools every turn; their split for the
  policy (``wire.messages.split_tools``, ``wire.anthropic.split_tools``: each schema checked and put in
  normal form, about 0.13 ms for Codex's) is kept by API and tools JSON and handed out again.

Nothing is remembered before the request is taken in whole, its session checked open (``commit``): the
list then takes the place of the kept one it went on from, or stands beside it when it is shorter or new.
Bounded per process in entries and bytes (least recently used out first), kept until the session's expiry
at most and forgotten at its finish (``proxy.session_memory``); a miss is only slower, and
``--resent-history check`` takes every body whole (a test holds both to the same answers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import orjson

from rollout_proxy.bounded import BoundedCache
from rollout_proxy.proxy.limits import load_json_object
from rollout_proxy.proxy.session_conversations import SessionConversations
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, canonical_key, extend_path_hash_by_key
from rollout_proxy.wire.images import ImageSet
from rollout_proxy.wire.json_bytes import right_sized, value_at
from rollout_proxy.wire.messages import ToolSet

#: kept lists: per session and API, ``session_conversations.PER_SESSION`` of them
MAX_SESSIONS = 16_384
MAX_LIST_BYTES = 192 * 1024 * 1024
#: the item memo: items (of any session) that passed their API's checks, by the API and their JSON as sent
MAX_ITEMS = 100_000
MAX_ITEM_BYTES = 32 * 1024 * 1024
#: rolling path hashes, by (parent hash, message key): each about ``_CHAIN_SIZE`` bytes
MAX_CHAIN_BYTES = 16 * 1024 * 1024
_CHAIN_SIZE = 200
#: requests' tools as their API splits them (``ToolSet``), by (API, tools JSON): a harness has a few
MAX_TOOL_SETS = 1024
MAX_TOOL_SET_BYTES = 32 * 1024 * 1024
#: a split's objects against its JSON's length (its schemas are the body's own, shared)
_TOOL_SET_SIZE_PER_BYTE = 2
#: the APIs whose lists are kept (a session may use all three; each keeps its own)
APIS = ("chat", "responses", "messages")


class Fold(Protocol):
    """Items folded into messages one by one, so that what a longer list adds is folded alone."""

    messages: list[dict[str, Any]]

    @property
    def images(self) -> ImageSet | None:
        """The images the messages hold (``wire.images``)."""
        ...

    @property
    def settled(self) -> int:
        """How many of ``messages`` no item added later can change."""
        ...

    def extended(self) -> Any:
        """A fold that goes on from this one without changing it."""
        ...

    def upto(self, count: int) -> Any:
        """A fold of only the items that made the first ``count`` of ``messages`` (nothing changed here),
        to go on from when a list resends only the start of a kept one; None where it cannot tell."""
        ...

    def add(self, item: Any, where: str) -> None: ...


F = TypeVar("F", bound=Fold)


@dataclass(frozen=True, slots=True)
class KeptList:
    """A list a session sent, taken in."""

    encoded: bytes  # the items as orjson writes the list (right-sized)
    offsets: list[int]  # where each item's JSON ends in ``encoded``
    items: list[Any]  # as parsed (kept as sent: a body that resends them reuses them)
    fold: Any  # the ``Fold`` they made (never changed in place: ``extended``)
    ends: list[int]  # how many of the fold's messages there were after each item
    keys: list[bytes]  # ``canonical_key`` of each of ``fold.messages``
    hashes: list[str]  # the rolling path hash after each of ``fold.messages``
    context: bytes  # what else the fold depends on: reused only when it is the same

    @property
    def size(self) -> int:
        """About what this keeps alive: the JSON, the items as parsed (a few times their JSON), the messages
        and their keys and hashes, the lists, and the images' bytes (a fetched URL's are not in the JSON)."""
        images = self.fold.images
        held = 0 if images is None else images.nbytes
        return 6 * len(self.encoded) + 400 * len(self.items) + len(self.context) + held + 200


@dataclass(frozen=True, slots=True)
class Folded(Generic[F]):
    """A list taken in: its fold, and the key and path hash of each of the fold's messages."""

    fold: F
    keys: list[bytes]
    hashes: list[str]


class ResentHistory:
    """The app's memory of resent lists (one per process: each worker has its own).

    Bounded in entries and bytes, and per session: a session's lists are forgotten when it finishes
    (``forget``) and, like the items and path hashes only its sessions sent, once the last session that
    sent them has expired (``expire``, on the app's timer). Every entry keeps the latest expiry of the
    sessions that used it."""

    def __init__(
        self,
        *,
        max_sessions: int = MAX_SESSIONS,
        max_list_bytes: int = MAX_LIST_BYTES,
        max_items: int = MAX_ITEMS,
        max_item_bytes: int = MAX_ITEM_BYTES,
        max_chain_bytes: int = MAX_CHAIN_BYTES,
    ) -> None:
        self._lists: SessionConversations[tuple[str, str], KeptList] = SessionConversations(
            max_sessions=max_sessions, max_bytes=max_list_bytes
        )
        self._items: BoundedCache[tuple[str, bytes], bool] = BoundedCache(
            max_entries=max_items, max_bytes=max_item_bytes
        )
        # (parent path hash, key) -> path hash: the same string objects come back every turn, so a lookup
        # costs two cached hashes
        self._chain: BoundedCache[tuple[str, bytes], str] = BoundedCache(
            max_entries=max_items, max_bytes=max_chain_bytes
        )
        # (API, tools JSON) -> the tools as split for the policy; shared by the requests that send that JSON,
        # so never changed by one
        self._tool_sets: BoundedCache[tuple[str, bytes], ToolSet] = BoundedCache(
            max_entries=MAX_TOOL_SETS, max_bytes=MAX_TOOL_SET_BYTES
        )
        self.hits = self.misses = 0  # item memo lookups, of the items past the kept start
        self.resent_bodies = 0  # bodies parsed only past a kept list (``load``)
        self.resent = 0  # lists folded on from a kept one
        #: items folded past the kept list they resend: a turn that goes on from one folds only its new items
        self.fresh_items = 0

    def intake(self, api: str, key: str, session_id: str, *, expires_at: float = 0.0) -> HistoryIntake:
        """One request's view: its body's list ``key`` of ``api``, for ``session_id`` (kept no longer than
        ``expires_at``, the session's expiry)."""
        return HistoryIntake(self, api=api, key=key, session_id=session_id, until=expires_at)

    def held(self) -> dict[str, int]:
        """Entries and estimated bytes of each part (what the memory docs and the soak benchmark report)."""
        return {
            "conversations": self._lists.count(),
            "conversation_bytes": self._lists.bytes,
            "messages": len(self._items),
            "message_bytes": self._items.bytes,
            "path_hashes": len(self._chain),
            "path_hash_bytes": self._chain.bytes,
            "tool_sets": len(self._tool_sets),
            "tool_set_bytes": self._tool_sets.bytes,
        }

    def lists(self, api: str, session_id: str) -> tuple[KeptList, ...]:
        """The session's lists of ``api``, the one used last first."""
        return self._lists.of((api, session_id))

    def last(self, api: str, session_id: str) -> KeptList | None:
        """The list of ``api`` the session sent last."""
        kept = self._lists.of((api, session_id))
        return kept[0] if kept else None

    def forget(self, session_id: str) -> None:
        """The session's lists, once it has finished (no turn will resend them)."""
        for api in APIS:
            self._lists.forget((api, session_id))

    def expire(self, now: float) -> int:
        """Drop what only sessions expired by ``now`` used; how many entries went."""
        return self._lists.expire(now) + self._items.expire(now) + self._chain.expire(now) + self._tool_sets.expire(now)

    def _path_hash(self, parent: str, key: bytes, until: float, computed: list[tuple[str, bytes, str]]) -> str:
        """``extend_path_hash_by_key``, as remembered, else computed (and added to ``computed``)."""
        found = self._chain.get((parent, key), until=until)
        if found is None:
            found = extend_path_hash_by_key(parent, key)
            computed.append((parent, key, found))
        return found


@dataclass(slots=True)
class _Pending:
    """What a request remembers once it is taken in whole (``HistoryIntake.commit``)."""

    checked: list[bytes] = field(default_factory=list)  # the items it checked, for the memo
    tools: bytes | None = None  # the JSON of the tools it checked, for the memo
    hashes: list[tuple[str, bytes, str]] = field(default_factory=list)  # path hashes it computed
    kept: KeptList | None = None
    resent: KeptList | None = None
    replace: bool = False


class HistoryIntake:
    """One request's list against the app's ``ResentHistory``: ``load`` the body, ``look_up`` which items
    need checking, ``take`` the fold, keys and path hashes (only the new items folded), then ``commit``."""

    def __init__(self, memory: ResentHistory, *, api: str, key: str, session_id: str, until: float) -> None:
        self.key = key  # the body's list it takes in
        self._memory, self._api, self._session_id, self._until = memory, api, session_id, until
        self._spliced: tuple[list[Any], KeptList] | None = None  # what ``load`` parsed past: (list, kept)
        self._looked_up: list[Any] | None = None
        self._prefix: tuple[KeptList, int] | None = None  # the list's first n items are the kept one's bytes
        self._raws: list[bytes] | None = None  # the JSON of each item after the prefix (None: not encodable)
        self._shared: list[tuple[int, KeptList]] = []  # (leading items the same, kept list): most first
        self._to_check: tuple[int, ...] = ()
        self._pending = _Pending()

    def load(self, body: bytes) -> dict[str, Any]:
        """The body as a JSON object (``limits.load_json_object``), the history it resends not parsed again:
        when its top-level ``"<key>":`` goes on with a kept list's JSON byte for byte (the longest) and then
        ``,`` or ``]``, those items are the ones parsed then (the same JSON parses to the same values) and only
        the rest is parsed. Anything else is parsed whole, so a bad body is refused in the same words."""
        key = b'"' + self.key.encode() + b'":'
        for kept in _longest_first(self._memory.lists(self._api, self._session_id)):
            payload = _after_resent(body, key, self.key, kept)
            if payload is not None:
                self._spliced = (payload[self.key], kept)
                self._memory.resent_bodies += 1
                return payload
        return load_json_object(body)

    def look_up(self, items: Any) -> tuple[int, ...] | None:
        """The indices of ``items`` still to check (the limits walk and the shape check skip the others);
        None when ``items`` is not a list (checked as ever). Nothing here walks the history ``load`` spliced."""
        if type(items) is not list:
            return None
        self._looked_up = items
        kept = self._memory.lists(self._api, self._session_id)
        spliced = self._spliced
        if spliced is not None and spliced[0] is items and any(each is spliced[1] for each in kept):
            base = spliced[1]  # ``load`` matched its JSON already: no need to write it again
            self._prefix = (base, len(base.items))
            self._raws = _encoded_items(items[len(base.items) :])
        else:
            self._raws = _encoded_items(items)
        if self._raws is not None:
            shared = [(same, each) for each in kept if (same := _same_start(self._raws, each, self._prefix))]
            self._shared = sorted(shared, key=lambda pair: pair[0], reverse=True)
        else:  # e.g. an integer past 64 bits: checked, and folded, the slow way
            self._prefix, self._shared = None, []
            return tuple(range(len(items)))
        start = self._shared[0][0] if self._shared else 0
        after = 0 if self._prefix is None else self._prefix[1]  # where ``_raws`` starts
        known, api = self._memory._items.get, self._api
        self._to_check = tuple(
            index
            for index in range(start, len(items))
            if known((api, self._raws[index - after]), until=self._until) is None
        )
        self._memory.hits += len(items) - len(self._to_check)
        self._memory.misses += len(self._to_check)
        self._pending.checked = [self._raws[index - after] for index in self._to_check]
        return self._to_check

    def tools_checked(self, tools: Any) -> bool:
        """Whether ``tools`` (the body's) passed its API's checks before, as this JSON (the item memo, keyed
        apart from the items): a harness sends the same tool schemas every turn. Else they are remembered once
        the request is taken in (``commit``)."""
        if type(tools) is not list or not tools:
            return False
        try:
            raw = orjson.dumps(tools)
        except (orjson.JSONEncodeError, TypeError):  # e.g. an integer past 64 bits: checked the slow way
            return False
        if self._memory._items.get((self._api + " tools", raw), until=self._until) is not None:
            return True
        self._pending.tools = raw
        return False

    def tool_set(self, tools: Any, split: Callable[[Any], ToolSet]) -> ToolSet:
        """``split(tools)`` (the API's split of the body's tools), once per API and tools JSON while the memory
        keeps it: a harness sends the same tools every turn. Asked once the request is taken in (its session
        checked open); the split returned is shared, never to be changed."""
        if type(tools) is not list or not tools:
            return split(tools)
        try:
            raw = orjson.dumps(tools)  # microseconds; a split of a harness's tools costs a hundred
        except (orjson.JSONEncodeError, TypeError):
            return split(tools)
        memory, key = self._memory, (self._api, raw)
        found = memory._tool_sets.get(key, until=self._until)
        if found is None:
            found = split(tools)  # refused: nothing remembered
            size = _TOOL_SET_SIZE_PER_BYTE * len(raw) + _ITEM_OVERHEAD
            memory._tool_sets.put((self._api, right_sized(raw)), found, size=size, until=self._until)
        return found

    def take(
        self,
        items: list[Any],
        start: Callable[[], F],
        *,
        context: bytes = b"",
        param: str | None = None,
        urls: Mapping[str, bytes] | None = None,
    ) -> Folded[F]:
        """The fold of ``items`` (the list ``look_up`` was given, checked since), its messages' keys and path
        hashes: a kept fold (or its start) extended by the items after those reused, when ``context`` is the
        same, else ``start()`` and every item. ``urls``: the request's image URLs' bytes, as fetched (None:
        image URLs are refused)."""
        where = param or self.key
        looked_up = items is self._looked_up
        alike = [(same, kept) for same, kept in self._shared if kept.context == context] if looked_up else []
        last, reused, base = None, 0, None
        for same, kept in alike:  # the one sharing the most whose fold can go on from there
            base = kept.fold.extended() if same == len(kept.items) else kept.fold.upto(kept.ends[same - 1])
            if base is not None:
                last, reused = kept, same
                break
        fold: F = start() if base is None else base
        if fold.images is not None:
            fold.images.urls = urls
        settled = 0 if last is None else min(last.ends[reused - 1], fold.settled)
        ends = [] if last is None else last.ends[:reused]
        for index in range(reused, len(items)):
            fold.add(items[index], f"{where}[{index}]")
            ends.append(len(fold.messages))
        message_keys = [] if last is None else last.keys[:settled]
        message_keys += [right_sized(canonical_key(message)) for message in fold.messages[settled:]]
        hashes = [] if last is None else last.hashes[:settled]
        current = hashes[-1] if hashes else EMPTY_PATH_HASH
        chain, until, computed = self._memory._path_hash, self._until, self._pending.hashes
        for message_key in message_keys[settled:]:
            current = chain(current, message_key, until, computed)
            hashes.append(current)
        if reused:
            self._memory.resent += 1
        self._memory.fresh_items += len(items) - reused
        if looked_up and self._raws is not None:
            encoded, offsets = self._encoded()
            kept = KeptList(encoded, offsets, list(items), fold, ends, message_keys, hashes, context)
            resent = alike[0][1] if alike else None  # what this list goes on from, unless it is shorter
            pending = self._pending
            pending.kept, pending.resent = kept, resent
            pending.replace = resent is not None and len(items) >= len(resent.items)
        return Folded(fold, message_keys, hashes)

    def commit(self) -> None:
        """The request is taken in (its session checked open): remember what it checked and its list."""
        pending, self._pending = self._pending, _Pending()
        memory, until = self._memory, self._until
        for raw in pending.checked:
            memory._items.put((self._api, right_sized(raw)), True, size=len(raw) + _ITEM_OVERHEAD, until=until)
        if pending.tools is not None:
            tools = pending.tools
            memory._items.put((self._api + " tools", tools), True, size=len(tools) + _ITEM_OVERHEAD, until=until)
        for parent, key, path_hash in pending.hashes:
            memory._chain.put((parent, key), path_hash, size=_CHAIN_SIZE, until=until)
        if pending.kept is not None:
            memory._lists.keep(
                (self._api, self._session_id), pending.kept, resent=pending.resent, replace=pending.replace, until=until
            )

    def _encoded(self) -> tuple[bytes, list[int]]:
        """The list's JSON as orjson writes it, and where each item ends in it (the kept prefix's as is)."""
        raws = self._raws or []
        parts: list[bytes] = []
        offsets: list[int] = []
        if self._prefix is not None and self._prefix[1]:
            kept, count = self._prefix
            parts.append(kept.encoded[1 : kept.offsets[count - 1]])
            offsets = kept.offsets[:count]
        position = offsets[-1] + 1 if offsets else 1
        for raw in raws:
            position += len(raw)
            offsets.append(position)
            position += 1  # its comma
        return right_sized(b"[" + b",".join([*parts, *raws]) + b"]"), offsets


#: about what an item memo entry keeps alive beside its JSON: the bytes object, its key, the cache's entry
_ITEM_OVERHEAD = 200


def _encoded_items(items: list[Any]) -> list[bytes] | None:
    """Each item as orjson writes it (the list's JSON is them joined by commas, in brackets)."""
    try:
        return [orjson.dumps(item) for item in items]
    except (orjson.JSONEncodeError, TypeError):  # e.g. an integer past 64 bits: checked the slow way
        return None


def _same_start(raws: list[bytes], kept: KeptList, prefix: tuple[KeptList, int] | None = None) -> int:
    """How many leading items are byte for byte ``kept``'s (a list that is not one of its conversations
    differs at its first item: one length compare, or one compare that stops at the first other byte); the
    list being ``prefix``'s first items (the kept list ``load`` parsed past), then those written ``raws``."""
    position, encoded = 1, kept.encoded  # past its opening bracket
    same = 0
    if prefix is not None and prefix[1]:
        same = _same_items(kept, *prefix)
        if same < prefix[1]:
            return same
        position = kept.offsets[same - 1] + 1
    for raw, end in zip(raws, kept.offsets[same:], strict=False):
        if end - position != len(raw) or not encoded.startswith(raw, position):
            break
        same += 1
        position = end + 1  # and its comma
    return same


def _same_items(kept: KeptList, other: KeptList, count: int) -> int:
    """How many of ``other``'s first ``count`` items ``kept`` begins with, byte for byte (a list that is not
    one of its conversations differs at its first item: one compare)."""
    if kept is other:
        return count
    position, same = 1, 0
    for end, own_end in zip(other.offsets[:count], kept.offsets, strict=False):
        if own_end != end or not kept.encoded.startswith(other.encoded[position:end], position):
            break
        same += 1
        position = end + 1
    return same


def _longest_first(kept: tuple[KeptList, ...]) -> list[KeptList]:
    """The kept lists a body may resend, the longest first: of two that it resends (one goes on with the
    other), the longer spares more."""
    return sorted((each for each in kept if each.items), key=lambda each: len(each.encoded), reverse=True)


_JSON_SPACE = b" \t\n\r"  # what JSON calls whitespace (bytes.strip() would take \x0b and \x0c too)
#: the added items are parsed under a key no body spells except as ``\u0000`` (checked absent)
_SPLICE = b'{"\\u0000":['


def _after_resent(body: bytes, key: bytes, name: str, kept: KeptList) -> dict[str, Any] | None:
    """``body`` parsed, when its top-level ``key`` (``"messages":``) is followed by ``kept``'s items (their
    JSON without the closing bracket) and then ``,`` or ``]``; else None (parse it whole).

    Three small parses instead of one large: the members before the key (``{...,`` closed with ``}``,
    which parses only if the key stands at the top level), the members after, with the added items
    under a placeholder key, and nothing of the history. A key sent twice (``name`` too, however
    spelled) ends as in a whole parse: the last value, at the first one's place."""
    before_bracket = kept.encoded[:-1]
    start = value_at(body, key, before_bracket)
    if start < 0:
        return None
    at, end = start - len(key), start + len(before_bracket)
    follows = body[end : end + 1]
    if follows == b",":
        rest = body[end + 1 :]
    elif follows == b"]":
        rest = body[end:]
    else:  # the last item goes on (or whitespace): not the same JSON
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
    before[name] = kept.items + added
    before.update(after)  # a key sent twice keeps its first place and its last value, as orjson parses it
    return before
