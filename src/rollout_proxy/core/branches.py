"""A session's tree as one rollout: how each node relates to the tree, and the sequences a trainer gets.

A harness rollout is rarely one conversation: subagents start conversations of their own,
compaction and edited histories rewrite a conversation from some message on, harnesses retry a
request. Each node's **branch** says which it is, derived from the tree alone (nothing to keep in
step with it; the client's own label, ``meta["branch_label"]``, is kept beside):

- ``new_conversation``: a root, sharing no message with any earlier path (the session's first
  conversation, a subagent, a side call such as a title);
- ``rewrite``: diverges from an existing path at message k > 0 (``from`` the node it diverged
  from, ``at_message`` k: compaction, an edited history); the tree recorded the fork when it placed it;
- ``retry``: the same input (parent and new messages) as an earlier node (``from`` that node);
- ``continuation``: extends its parent with new messages.

The **sequences** are the root-to-leaf paths of the generated leaves (a generated node no generated
node descends from; trailing injected messages train nothing and are left off). Every sampled token
is trained (loss weight 1) in exactly one sequence: the *main* sequence (the one ending at the latest
generated leaf, what a single rollout emitted before branches) trains every node on its path, then
each other sequence, oldest leaf first, trains the nodes no earlier sequence trained; a shared node is
weighted 0 in every sequence but the one that trains it. With ``retry="drop"`` (the default) of the
nodes sharing one input, only those the conversation went on from are trained (the latest, when it
went on from none): the others' sequences are *dropped*, all their weights 0, their tokens counted as
dropped. So ``sampled_tokens == trained_tokens + dropped_tokens``, and with ``retry="keep"`` every
sampled token is trained once.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout_proxy.records import NodeKind, ResponseNode
from rollout_proxy.tokenization.messages import canonical_key

RETRY_POLICIES = ("keep", "drop")
#: where a request names its branch: a header, or the ``rollout_branch`` key of its ``metadata``
BRANCH_HEADER = "X-Rollout-Branch"
BRANCH_METADATA_KEY = "rollout_branch"
MAX_BRANCH_LABEL = 200


class BranchKind(str, enum.Enum):
    CONTINUATION = "continuation"
    REWRITE = "rewrite"
    NEW_CONVERSATION = "new_conversation"
    RETRY = "retry"


@dataclass(frozen=True, slots=True)
class Branch:
    kind: BranchKind
    label: str | None = None
    from_: str | None = None  # the node it extends, diverged from, or retries
    at_message: int | None = None  # a rewrite: the first message that differs

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "label": self.label, "from": self.from_, "at_message": self.at_message}


def _input_key(node: ResponseNode) -> tuple[str | None, bytes]:
    """What a node was asked: its parent and the canonical keys of its input messages."""
    inputs = node.messages[: node.n_input_messages]
    return node.parent_id, b"\x00".join(canonical_key(message) for message in inputs)


def branches(nodes: Sequence[ResponseNode]) -> dict[str, Branch]:
    """Every node's branch; ``nodes`` oldest first (as the stores' ``get_nodes`` gives them)."""
    found: dict[str, Branch] = {}
    first_with_input: dict[tuple[str | None, bytes], str] = {}
    for node in nodes:
        label = node.meta.get("branch_label")
        earlier = first_with_input.setdefault(_input_key(node), node.id)
        if earlier != node.id:  # first: a retried rewrite was placed as a fork again
            branch = Branch(BranchKind.RETRY, label, earlier)
        elif node.fork:
            branch = Branch(BranchKind.REWRITE, label, node.fork.get("diverged_from"), node.fork.get("at_message"))
        elif node.parent_id is None:
            branch = Branch(BranchKind.NEW_CONVERSATION, label)
        else:
            branch = Branch(BranchKind.CONTINUATION, label, node.parent_id)
        found[node.id] = branch
    return found


@dataclass(frozen=True, slots=True)
class RolloutSequence:
    """One root-to-leaf path and the nodes whose sampled tokens it trains."""

    path: list[ResponseNode]
    trained: frozenset[str]  # ids of the generated nodes on ``path`` this sequence trains
    branch: Branch  # where it leaves the tree: its deepest node that is not a plain continuation
    main: bool
    dropped: bool

    @property
    def leaf(self) -> ResponseNode:
        return self.path[-1]


@dataclass(frozen=True, slots=True)
class Rollout:
    sequences: list[RolloutSequence]  # the main one first, then oldest leaf first
    branches: dict[str, Branch]
    sampled_tokens: int
    trained_tokens: int
    dropped_tokens: int

    @property
    def main(self) -> RolloutSequence | None:
        return self.sequences[0] if self.sequences else None


def rollout(nodes: Sequence[ResponseNode], *, retry: str = "drop") -> Rollout:
    """The session's sequences and its token counts (module docstring); ``nodes`` oldest first."""
    if retry not in RETRY_POLICIES:
        raise ValueError(f"retry must be one of {RETRY_POLICIES}, not {retry!r}")
    by_id = {node.id: node for node in nodes}
    generated_below: set[str] = set()  # nodes a generated node descends from
    for node in reversed(nodes):  # a child is written after its parent
        if node.parent_id is not None and (node.kind is NodeKind.GENERATED or node.id in generated_below):
            generated_below.add(node.parent_id)
    generated = [node for node in nodes if node.kind is NodeKind.GENERATED]
    leaves = [node for node in generated if node.id not in generated_below]
    dropped = _dropped_retries(generated, generated_below) if retry == "drop" else set()
    kept = [leaf for leaf in leaves if leaf.id not in dropped]
    ordered = [*kept[-1:], *kept[:-1], *(leaf for leaf in leaves if leaf.id in dropped)]
    found = branches(nodes)
    paths = [_path(leaf, by_id) for leaf in ordered]
    assigned = train_once([[] if leaf.id in dropped else path for leaf, path in zip(ordered, paths, strict=True)])
    sequences = []
    for index, (leaf, path, mine) in enumerate(zip(ordered, paths, assigned, strict=True)):
        is_dropped = leaf.id in dropped
        departs = next((n for n in reversed(path) if found[n.id].kind is not BranchKind.CONTINUATION), path[0])
        main = index == 0 and not is_dropped
        sequences.append(RolloutSequence(path, mine, found[departs.id], main=main, dropped=is_dropped))
    sampled = sum(len(node.output_ids) for node in generated)
    trained = sum(len(by_id[node_id].output_ids) for mine in assigned for node_id in mine)
    return Rollout(sequences, found, sampled, trained, sampled - trained)


def train_once(paths: Sequence[Sequence[ResponseNode]]) -> list[frozenset[str]]:
    """The generated nodes each path trains, every node in exactly one: the first path (in the given order)
    that holds it. The one rule of every finish: the export's order (main first, then oldest leaf first) and
    a finish's naming order alike."""
    trained_somewhere: set[str] = set()
    assigned = []
    for path in paths:
        mine = frozenset(n.id for n in path if n.kind is NodeKind.GENERATED and n.id not in trained_somewhere)
        trained_somewhere |= mine
        assigned.append(mine)
    return assigned


def _dropped_retries(generated: Sequence[ResponseNode], generated_below: set[str]) -> set[str]:
    """Generated leaves that retried an input another node shares and that the conversation did not go on
    from: of each set of nodes with one input, those with generated descendants are kept (the latest one
    when none has any), the other leaves are dropped."""
    by_input: dict[tuple[str | None, bytes], list[ResponseNode]] = defaultdict(list)
    for node in generated:
        by_input[_input_key(node)].append(node)
    dropped: set[str] = set()
    for same in by_input.values():
        if len(same) < 2:
            continue
        went_on = [node for node in same if node.id in generated_below]
        keep = {node.id for node in went_on} or {same[-1].id}
        dropped.update(node.id for node in same if node.id not in keep)
    return dropped


def _path(leaf: ResponseNode, by_id: dict[str, ResponseNode]) -> list[ResponseNode]:
    path = []
    current: ResponseNode | None = leaf
    while current is not None:
        path.append(current)
        current = by_id.get(current.parent_id) if current.parent_id is not None else None
    path.reverse()
    return path


def branch_label(header: str | None, metadata: Any) -> str | None:
    """The label a request gives its branch (the header wins), or None; ``ValueError`` for a bad one."""
    label = header if header is not None else metadata.get(BRANCH_METADATA_KEY) if isinstance(metadata, dict) else None
    if label is None:
        return None
    if not isinstance(label, str) or not 0 < len(label) <= MAX_BRANCH_LABEL or not label.isprintable():
        raise ValueError(f"a branch label must be 1 to {MAX_BRANCH_LABEL} printable characters")
    return label
