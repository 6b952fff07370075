"""Where a request attaches to a session's response tree.

Two ways to name a parent:

- by content (Chat Completions, and Responses calls without ``previous_response_id``):
  the deepest node whose message path is a prefix of the conversation, found with one
  store read of the rolling path hashes. When the conversation agrees with part of an
  existing node's messages and then differs, it rewrote history: the new node forks
  there and records which node it diverged from and at which message, never
  splicing silently;
- by id (``previous_response_id``): that node, within the session.

Content leaves out what tells two siblings apart (reasoning, the proxy's tool-call ids), so the nodes of a
group's samples that reach the same visible answer share a path: its path-index entry names them all,
newest first (``state.store.with_sibling``). A conversation that ends at such a path continues the one the
client was answered, named by what it echoes of that answer (``sibling``): the proxy's tool-call ids, the
reasoning, a signed thinking block (the Messages API), or, failing those, the reasoning it echoes of an
earlier turn (each sibling's path read once). Where nothing it echoes tells them apart the proxy cannot
know: it takes the newest sibling no turn has continued yet (else the newest), counts it
(``parent_ambiguities_total``) and records it on the new node (``parent_ambiguity``); never a silent pick.

Where the session's sample goes in a conversation that starts at the root (``place_sample``): the
policy sees every message once, in the order the client sent it. A conversation that starts with the
sample, or holds it in order elsewhere (a harness's own prompt around the task), is taken as sent; one
that holds none of it gets it after its leading system and developer messages (the instructions stay
first); one that holds only part of it, or holds it out of order, is taken as sent and the node says so
(``SamplePlacement``). A session without sample messages (a harness owns the prompt) takes every
conversation as sent.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import structlog

from rollout_proxy.errors import InvalidRequest, NotFound
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import NodeKind, ResponseNode, SessionRecord
from rollout_proxy.state.store import NOT_READ, SessionLease, StateStore
from rollout_proxy.tokenization.messages import EMPTY_PATH_HASH, canonical_key, path_hashes

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Placement:
    """Where new messages attach: the parent's path, the messages, and their path hashes.

    The hashes are computed once, when the parent is found, and stored with the new node.
    """

    parent: list[ResponseNode]  # root-to-parent path; empty for the root
    new_messages: list[dict[str, Any]]
    new_hashes: list[str]  # rolling path hash after each new message
    fork: dict[str, Any] | None = None
    #: how the session's sample stands in a conversation placed at the root (``place_sample``); None: not asked
    sample: SamplePlacement | None = None
    #: the parent is one of several siblings nothing the client echoed tells apart (``sibling``): how many, and
    #: the rule that chose it; None: the parent is the only node the conversation can continue
    ambiguity: dict[str, Any] | None = None

    @property
    def parent_id(self) -> str | None:
        return self.parent[-1].id if self.parent else None

    @property
    def end_hash(self) -> str:
        """The path hash after the last new message (the parent's own when there is none)."""
        if self.new_hashes:
            return self.new_hashes[-1]
        return self.parent[-1].path_hash if self.parent else EMPTY_PATH_HASH


#: How many of a conversation's last path hashes a turn looks up first. A turn usually resends the
#: history it was given plus a few messages, so the deepest whole-node match is among the last few:
#: the rolling hashes make a match there vouch for every message before it, and the lookup does not
#: grow with the history. Only when none of them ends a node (a new conversation, or history rewritten
#: further back) is the whole list looked up.
MATCH_WINDOW = 8


def match_window(hashes: Sequence[str]) -> tuple[str, ...]:
    """The hashes a turn looks up first (``MATCH_WINDOW``)."""
    return tuple(hashes[-MATCH_WINDOW:])


def choose_parent(
    matches: Sequence[str | None], n_messages: int, *, offset: int = 0
) -> tuple[str | None, int, dict[str, Any] | None]:
    """(parent id, how many messages it covers, fork provenance or None).

    ``matches[i]`` is the path-index entry for the first ``offset``+i+1 messages: ``"id"`` where
    a node's path ends, ``"id#k"`` inside a node's messages. Only the deepest entry
    inside a node decides: the request forks there if it goes on past it with other
    messages, and is a sibling of that node's output if it simply ends there (a group's
    samples all send the same prompt).
    """
    parent_id, covered = None, 0
    for index in range(len(matches) - 1, -1, -1):  # the deepest whole-node entry
        value = matches[index]
        if value is not None and "#" not in value:
            parent_id, covered = value, offset + index + 1
            break
    for index in range(len(matches) - 1, covered - offset - 1, -1):
        value = matches[index]
        if value is not None and "#" in value:
            if offset + index + 1 < n_messages:
                at = offset + index + 1
                return parent_id, covered, {"diverged_from": value.split("#", 1)[0], "at_message": at}
            break
    return parent_id, covered, None


# -- siblings: what tells apart nodes whose messages are equal by content -----------------------------
#
# Entries of the path index beside the path hashes (a hash is hex, these have a prefix), written with each
# node (``node_entries``, never overwritten): its output's tool-call ids and reasoning, and its first child.


def call_mark(call_id: str) -> str:
    return "call:" + call_id


def reasoning_mark(path_hash: str, reasoning: str) -> str:
    digest = hashlib.blake2b(f"{path_hash}\x00{reasoning}".encode(), digest_size=16).hexdigest()
    return "think:" + digest


def child_mark(node_id: str) -> str:
    return "child:" + node_id


def echo_marks(message: dict[str, Any], path_hash: str) -> list[tuple[str, str]]:
    """(what, index key) of what an assistant message carries beyond its content: each tool-call id, its
    reasoning (keyed with the path it ends, ``path_hash``); the same for a node's output and a client's echo."""
    if message["role"] != "assistant":
        return []
    marks = [("tool_call_id", call_mark(call["id"])) for call in message.get("tool_calls") or ()]
    if reasoning := message.get("reasoning_content"):
        marks.append(("reasoning", reasoning_mark(path_hash, reasoning)))
    return marks


def node_entries(node: ResponseNode) -> dict[str, str]:
    """The sibling entries a node writes (``node.path_hash`` set): its output's marks and its parent's child."""
    entries = {}
    if node.kind is NodeKind.GENERATED and node.messages:
        entries = {key: node.id for _, key in echo_marks(node.messages[-1], node.path_hash)}
    if node.parent_id is not None:
        entries[child_mark(node.parent_id)] = node.id
    return entries


def _agrees(output: dict[str, Any], echoed: dict[str, Any]) -> bool:
    """Whether what ``echoed`` carries of an answer beyond its content is ``output``'s (what it leaves out
    agrees with anything)."""
    if echoed["role"] != "assistant":
        return True
    if (reasoning := echoed.get("reasoning_content")) and reasoning != output.get("reasoning_content"):
        return False
    calls = echoed.get("tool_calls")
    return not calls or [call["id"] for call in calls] == [call["id"] for call in output.get("tool_calls") or ()]


class SamplePlacement(str, Enum):
    """How a conversation that starts at the root holds the session's sample messages."""

    NO_SAMPLE = "no_sample"  # the session has none (a harness owns the prompt): taken as sent
    PREFIX = "prefix"  # it starts with them: taken as sent
    CONTAINED = "contained"  # all of them, in order, after other messages (a harness's prompt around the task)
    INSERTED = "inserted"  # none of them: the sample was put after the leading system/developer messages
    ABSENT = "absent"  # none of them, and the API takes the conversation as sent (Chat Completions): flagged
    PARTIAL = "partial"  # only some of them: taken as sent, flagged
    OUT_OF_ORDER = "out_of_order"  # all of them, not in the sample's order: taken as sent, flagged

    @property
    def flagged(self) -> bool:
        """Recorded on the node (and counted): the proxy added messages, or the sample is not all there."""
        return self not in (SamplePlacement.NO_SAMPLE, SamplePlacement.PREFIX, SamplePlacement.CONTAINED)


_LEADING_ROLES = frozenset({"system", "developer"})


def place_sample(
    sample: Sequence[dict[str, Any]],
    conversation: Sequence[dict[str, Any]],
    *,
    keys: Sequence[bytes] | None = None,
    insert: bool = True,
) -> tuple[list[dict[str, Any]], SamplePlacement]:
    """The conversation the policy sees for a request that starts at the root, and how the sample stands
    in it (see the module docstring). ``keys``: the conversation's ``canonical_key``s, if the caller has
    them (a long resent history: nothing is keyed twice). ``insert=False``: a conversation that holds none
    of the sample is taken as sent too (``ABSENT``: Chat Completions, whose client sends the whole
    conversation). Never merges: a message is the sample's only when it is equal to one (``canonical_key``)."""
    if not sample:
        return list(conversation), SamplePlacement.NO_SAMPLE
    wanted = [canonical_key(message) for message in sample]
    keys = [canonical_key(message) for message in conversation] if keys is None else keys
    if list(keys[: len(wanted)]) == wanted:
        return list(conversation), SamplePlacement.PREFIX
    members = set(wanted)
    found = [key for key in keys if key in members]
    if not found:
        if not insert:
            return list(conversation), SamplePlacement.ABSENT
        lead = 0
        while lead < len(conversation) and conversation[lead]["role"] in _LEADING_ROLES:
            lead += 1
        return [*conversation[:lead], *sample, *conversation[lead:]], SamplePlacement.INSERTED
    if _in_order(wanted, found):
        return list(conversation), SamplePlacement.CONTAINED
    remaining = list(found)
    for key in wanted:
        if key not in remaining:
            return list(conversation), SamplePlacement.PARTIAL
        remaining.remove(key)
    return list(conversation), SamplePlacement.OUT_OF_ORDER


def _in_order(wanted: Sequence[bytes], found: Sequence[bytes]) -> bool:
    """Whether ``wanted`` is a subsequence of ``found``."""
    stream = iter(found)
    return all(any(key == candidate for candidate in stream) for key in wanted)


class ResponseTree:
    def __init__(self, *, store: StateStore, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics

    @property
    def metrics(self) -> Metrics:
        return self._metrics

    async def path(
        self,
        session_id: str,
        response_id: str,
        *,
        param: str = "previous_response_id",
        lease: SessionLease | None = None,
    ) -> list[ResponseNode]:
        """``lease``: the turn's session read (``state.store.SessionLease``), which may have read it already."""
        path = await self._read_path(session_id, response_id, lease)
        if path is None:
            raise NotFound(f"response {response_id!r} not found in this session", param=param)
        return path

    async def _read_path(self, session_id: str, node_id: str, lease: SessionLease | None) -> list[ResponseNode] | None:
        """The path, from what ``lease`` read ahead when it read it, else from the store."""
        found = NOT_READ if lease is None else lease.take_path(node_id)
        return await self._store.get_path(session_id, node_id) if found is NOT_READ else found

    async def _match(self, session_id: str, hashes: Sequence[str], lease: SessionLease | None) -> list[str | None]:
        """The path-index entries, from what ``lease`` read ahead when it read those, else from the store."""
        found = NOT_READ if lease is None or not hashes else lease.take_matches(hashes)
        return await self._store.match_paths(session_id, hashes) if found is NOT_READ else found

    async def locate(
        self,
        session: SessionRecord,
        messages: list[dict[str, Any]],
        *,
        api: str,
        hashes: Sequence[str] | None = None,
        named: Mapping[int, str] | None = None,
        lease: SessionLease | None = None,
    ) -> Placement:
        """Attach a whole conversation by content (``hashes``: its path hashes, if the caller has them;
        ``named``: message index -> the node an echoed message names, a signed thinking block; ``lease``: the
        turn's session read, which read the window's entries and the path they end at with the session)."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        hashes = path_hashes(messages) if hashes is None else list(hashes)
        offset = len(hashes) - len(window := match_window(hashes))
        matches = await self._match(session.id, window, lease)  # a match there vouches for all before it
        if offset and not any(value is not None and "#" not in value for value in matches):
            matches, offset = await self._store.match_paths(session.id, hashes), 0  # no node ends in the window
        parent_id, covered, fork = choose_parent(matches, len(messages), offset=offset)
        ambiguity = None
        if parent_id is not None and "|" in parent_id:  # siblings end here: the one the client was answered
            parent_id, ambiguity = await self.sibling(
                session, messages, hashes, covered, parent_id.split("|"), api=api, named=named or {}, lease=lease
            )
        if fork is not None:
            self._metrics.inc("forks_total", api=api)
            log.info("history_rewritten", parent_id=parent_id, **fork)
        parent = [] if parent_id is None else await self.path(session.id, parent_id, param="messages", lease=lease)
        return Placement(
            parent=parent,
            new_messages=messages[covered:],
            new_hashes=hashes[covered:],
            fork=fork,
            ambiguity=ambiguity,
        )

    async def sibling(
        self,
        session: SessionRecord,
        messages: Sequence[dict[str, Any]],
        hashes: Sequence[str],
        covered: int,
        candidates: Sequence[str],
        *,
        api: str,
        named: Mapping[int, str],
        lease: SessionLease | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Which of ``candidates`` (newest first, their paths end at ``messages[:covered]``) the conversation
        continues, and the ambiguity when nothing it echoes tells (module docstring). One index read; the
        siblings' paths only when an earlier turn's echoed reasoning is all there is to go by."""
        last = covered - 1
        if named.get(last) in candidates:
            self._metrics.inc("sibling_parents_total", api=api, by="signature")
            self._metrics.inc("parents_by_signature_total", api=api)
            return named[last], None
        marks = echo_marks(messages[last], hashes[last])
        keys = [key for _, key in marks] + [child_mark(candidate) for candidate in candidates]
        found = dict(zip(keys, await self._store.match_paths(session.id, keys), strict=True))
        by_mark = {node: what for what, key in marks if (node := found[key]) is not None and node in candidates}
        if len(by_mark) == 1:
            chosen, what = next(iter(by_mark.items()))
            self._metrics.inc("sibling_parents_total", api=api, by=what)
            return chosen, None
        pool = [candidate for candidate in candidates if candidate in by_mark] or list(candidates)
        if any(index < last for index in named) or any(
            messages[index].get("reasoning_content") for index in range(last)
        ):
            agreeing = await self._agreeing(session, messages, pool, covered, named, lease)
            if len(agreeing) == 1:
                self._metrics.inc("sibling_parents_total", api=api, by="history")
                return agreeing[0], None
            pool = agreeing or pool
        free = [candidate for candidate in pool if found[child_mark(candidate)] is None]
        chosen, rule = (free[0], "newest_not_continued") if free else (pool[0], "newest")
        self._metrics.inc("parent_ambiguities_total", api=api)
        log.info("parent_ambiguous", parent_id=chosen, candidates=len(pool), rule=rule, api=api)
        return chosen, {"candidates": len(pool), "rule": rule}

    async def _agreeing(
        self,
        session: SessionRecord,
        messages: Sequence[dict[str, Any]],
        candidates: Sequence[str],
        covered: int,
        named: Mapping[int, str],
        lease: SessionLease | None,
    ) -> list[str]:
        """The candidates whose every answer agrees with what ``messages`` echoes of it (``_agrees``) and whose
        nodes are the ones ``named`` names."""
        paths = await asyncio.gather(*(self._read_path(session.id, candidate, lease) for candidate in candidates))
        agreeing = []
        for candidate, path in zip(candidates, paths, strict=True):
            if not path:
                continue
            at, agrees = 0, True
            for node in path:
                at += len(node.messages)
                end = at - 1
                if end >= covered:
                    break
                if named.get(end, node.id) != node.id or (
                    node.kind is NodeKind.GENERATED and not _agrees(node.messages[-1], messages[end])
                ):
                    agrees = False
                    break
            if agrees:
                agreeing.append(candidate)
        return agreeing

    async def after(
        self,
        session: SessionRecord,
        previous_response_id: str,
        messages: list[dict[str, Any]],
        *,
        lease: SessionLease | None = None,
    ) -> Placement:
        """Attach new messages under a named node; an echo of its own output is dropped."""
        parent = await self.path(session.id, previous_response_id, lease=lease)
        own, own_hash = parent[-1].messages[-1], parent[-1].path_hash
        if messages and messages[0]["role"] == own["role"] and canonical_key(messages[0]) == canonical_key(own):
            messages = messages[1:]
        return Placement(parent=parent, new_messages=messages, new_hashes=path_hashes(messages, start=own_hash))
