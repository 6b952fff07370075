"""Where a request attaches to a session's response tree.

Two ways to name a parent:

- by content (Chat Completions, and Responses calls without ``previous_response_id``):
  the deepest node whose message path is a prefix of the conversation, found with one
  store read of the rolling path hashes. When the conversation agrees with part of an
  existing node's messages and then differs, it rewrote history: the new node forks
  there and records which node it diverged from and at which message, never
  splicing silently;
- by id (``previous_response_id``): that node, within the session.

Where the session's sample goes in a conversation that starts at the root (``place_sample``): the
policy sees every message once, in the order the client sent it. A conversation that starts with the
sample, or holds it in order elsewhere (a harness's own prompt around the task), is taken as sent; one
that holds none of it gets it after its leading system and developer messages (the instructions stay
first); one that holds only part of it, or holds it out of order, is taken as sent and the node says so
(``SamplePlacement``). A session without sample messages (a harness owns the prompt) takes every
conversation as sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import structlog

from rollout_proxy.errors import InvalidRequest, NotFound
from rollout_proxy.metrics import Metrics
from rollout_proxy.records import ResponseNode, SessionRecord
from rollout_proxy.state.store import StateStore
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

    async def path(
        self, session_id: str, response_id: str, *, param: str = "previous_response_id"
    ) -> list[ResponseNode]:
        path = await self._store.get_path(session_id, response_id)
        if path is None:
            raise NotFound(f"response {response_id!r} not found in this session", param=param)
        return path

    async def locate(
        self, session: SessionRecord, messages: list[dict[str, Any]], *, api: str, hashes: Sequence[str] | None = None
    ) -> Placement:
        """Attach a whole conversation by content (``hashes``: its path hashes, if the caller has them)."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        hashes = path_hashes(messages) if hashes is None else list(hashes)
        offset = len(hashes) - len(window := match_window(hashes))
        matches = await self._store.match_paths(session.id, window)  # a match there vouches for all before it
        if offset and not any(value is not None and "#" not in value for value in matches):
            matches, offset = await self._store.match_paths(session.id, hashes), 0  # no node ends in the window
        parent_id, covered, fork = choose_parent(matches, len(messages), offset=offset)
        if fork is not None:
            self._metrics.inc("forks_total", api=api)
            log.info("history_rewritten", parent_id=parent_id, **fork)
        parent = [] if parent_id is None else await self.path(session.id, parent_id, param="messages")
        return Placement(parent=parent, new_messages=messages[covered:], new_hashes=hashes[covered:], fork=fork)

    async def after(
        self, session: SessionRecord, previous_response_id: str, messages: list[dict[str, Any]]
    ) -> Placement:
        """Attach new messages under a named node; an echo of its own output is dropped."""
        parent = await self.path(session.id, previous_response_id)
        own, own_hash = parent[-1].messages[-1], parent[-1].path_hash
        if messages and messages[0]["role"] == own["role"] and canonical_key(messages[0]) == canonical_key(own):
            messages = messages[1:]
        return Placement(parent=parent, new_messages=messages, new_hashes=path_hashes(messages, start=own_hash))
