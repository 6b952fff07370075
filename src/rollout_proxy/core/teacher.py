"""The teacher pass of on-policy distillation: a teacher's logprob for every token the student trained on.

The teacher sees the student's exact tokens, with each ``teacher_context`` message rendered by the
teacher's chat template and inserted at the turn boundary before its ``qa_index``-th assistant turn
(counted over the turns the policy generated on the trajectory's path). The boundary is right after
the last end-of-turn token before that turn's output, so the fragment is a bridge (as for injected
messages) between the previous message and the turn's generation prompt::

    student  [system..user<eot>]                 [\\n<im_start>assistant\\n][output<eot>]...
    teacher  [system..user<eot>][\\n<im_start>user\\nCTX<eot>][\\n<im_start>assistant\\n][output<eot>]...

One ``/v1/completions`` call scores the whole view (``max_tokens: 1``, ``prompt_logprobs: k``);
``positions`` maps each student token to its place in the view, so the answer aligns with the
student's ``total_token_ids``. The same view, without scoring, is the critic's (``critic_context``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rollout_proxy.engines.base import PromptImages, clamped_logprob
from rollout_proxy.errors import EngineError, InvalidRequest
from rollout_proxy.records import NodeKind, ResponseNode, TeacherScores, TopLogprobs
from rollout_proxy.tokenization.renderer import ChatRenderer
from rollout_proxy.wire.arrays import encode_array

#: the seed's bound on ``topk`` (vLLM's ``--max-logprobs`` on the teacher must be at least this)
MAX_TOPK = 128
#: the text both tokenizers must encode alike before a teacher scores a student's tokens
CANONICAL_TEXT = (
    "On-policy distillation: 0123456789, ½ café naïve 東京 🙂 <think>x</think>\n\tdef f(a, b): return a ** b"
)


class PromptScorer(Protocol):
    """An engine that scores a prompt: vLLM's ``prompt_logprobs`` (entry 0 is None)."""

    async def prompt_logprobs(
        self, prompt_ids: np.ndarray, k: int, *, images: PromptImages | None = None
    ) -> list[dict[str, Any] | None]: ...


@dataclass(frozen=True, slots=True)
class Boundary:
    """Where context for one assistant turn goes: ``at`` in ``total_token_ids``, after a ``after_role`` message."""

    at: int
    after_role: str


@dataclass(frozen=True, slots=True)
class View:
    """The student's tokens with fragments inserted; ``positions[i]`` is student token i's index in ``ids``."""

    ids: np.ndarray  # int32
    positions: np.ndarray  # int64, strictly increasing
    fragments: tuple[tuple[int, int], ...]  # [start, end) in ``ids`` of each inserted fragment

    @property
    def n_tokens_injected(self) -> int:
        return len(self.ids) - len(self.positions)


def teacher_fields(scores: TeacherScores) -> dict[str, Any]:
    """The trajectory's fields (as ``wire.Trajectory`` names them) for a teacher pass."""
    return {
        "teacher": scores.teacher,
        "total_teacher_logprobs": [None if math.isnan(v) else v for v in scores.logprobs.astype(np.float64).tolist()],
        "teacher_topk": None
        if scores.topk is None
        else {"ids": encode_array(scores.topk.ids), "logprobs": encode_array(scores.topk.logprobs)},
    }


def turn_boundaries(path: Sequence[ResponseNode], end_of_turn: int) -> list[Boundary]:
    """One boundary per generated turn on ``path``, in order (``qa_index`` indexes this list)."""
    boundaries: list[Boundary] = []
    ids = np.concatenate([part for node in path for part in (node.prompt_ids, node.output_ids)] or [np.zeros(0)])
    closes = np.flatnonzero(ids == end_of_turn)
    position, role = 0, "user"
    for node in path:
        position += len(node.prompt_ids)
        inputs = node.messages[: node.n_input_messages]
        if inputs:
            role = str(inputs[-1].get("role", "user"))
        if node.kind is NodeKind.GENERATED:
            before = closes[closes < position]
            if not len(before):
                raise EngineError("no end-of-turn token precedes an assistant turn: no boundary to insert context at")
            boundaries.append(Boundary(at=int(before[-1]) + 1, after_role=role))
        position += len(node.output_ids)
        if len(node.messages) > node.n_input_messages:
            role = str(node.messages[-1].get("role", "assistant"))
    return boundaries


def build_view(ids: np.ndarray, insertions: Sequence[tuple[int, np.ndarray]]) -> View:
    """``ids`` with each fragment inserted before position ``at`` (in order; several at one place keep it)."""
    ordered = sorted(enumerate(insertions), key=lambda item: (item[1][0], item[0]))
    parts, fragments = [], []
    positions = np.arange(len(ids), dtype=np.int64)
    cursor = shift = 0
    for _, (at, fragment) in ordered:
        if not 0 <= at <= len(ids):
            raise ValueError(f"insertion at {at} is outside the {len(ids)} tokens")
        parts.append(ids[cursor:at])
        start = at + shift
        parts.append(np.asarray(fragment, dtype=np.int32))
        fragments.append((start, start + len(fragment)))
        positions[at:] += len(fragment)
        shift += len(fragment)
        cursor = at
    parts.append(ids[cursor:])
    return View(
        ids=np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, dtype=np.int32),
        positions=positions,
        fragments=tuple(fragments),
    )


def contexts_by_turn(
    contexts: Sequence[Mapping[str, Any]], n_turns: int, *, param: str
) -> dict[int, list[dict[str, Any]]]:
    """``[{qa_index, message}]`` grouped by turn, in order; a ``qa_index`` past the last turn is refused."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for index, context in enumerate(contexts):
        qa_index, message = context.get("qa_index"), context.get("message")
        if not isinstance(qa_index, int) or isinstance(qa_index, bool) or qa_index < 0:
            raise InvalidRequest("qa_index must be an integer >= 0", param=f"{param}[{index}].qa_index")
        if qa_index >= n_turns:
            raise InvalidRequest(
                f"qa_index {qa_index} is past the trajectory's {n_turns} assistant turn(s)",
                param=f"{param}[{index}].qa_index",
            )
        if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
            raise InvalidRequest(
                "a context's message must be a message with text content", param=f"{param}[{index}].message"
            )
        grouped.setdefault(qa_index, []).append(dict(message))
    return grouped


async def render_view(
    renderer: ChatRenderer,
    path: Sequence[ResponseNode],
    total_token_ids: np.ndarray,
    contexts: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
    param: str = "teacher_context",
) -> View:
    """The student's tokens with ``contexts`` rendered (by ``renderer``'s template) at their turns."""
    if not contexts:
        return build_view(total_token_ids, [])
    boundaries = turn_boundaries(path, await renderer.end_of_turn_id())
    grouped = contexts_by_turn(contexts, len(boundaries), param=param)
    insertions = []
    for qa_index, messages in sorted(grouped.items()):
        boundary = boundaries[qa_index]
        fragment = await renderer.bridge(
            messages,
            after_role=boundary.after_role,
            after_closed=True,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=False,
        )
        insertions.append((boundary.at, fragment))
    return build_view(total_token_ids, insertions)


def read_prompt_logprobs(
    entries: Sequence[dict[str, Any] | None], view_ids: np.ndarray, topk: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The chosen token's logprob at every view position (NaN at 0), and the top-``topk`` (ids, logprobs)."""
    if len(entries) != len(view_ids):
        raise EngineError(f"the teacher returned {len(entries)} prompt logprobs for {len(view_ids)} prompt tokens")
    chosen = np.full(len(view_ids), np.nan, dtype=np.float64)
    ids = np.full((len(view_ids), topk), -1, dtype=np.int32) if topk >= 2 else None
    logprobs = np.full((len(view_ids), topk), np.nan, dtype=np.float32) if topk >= 2 else None
    for position, entry in enumerate(entries):
        if entry is None:
            if position:
                raise EngineError(f"the teacher returned no prompt logprob at position {position}")
            continue
        found = entry.get(str(int(view_ids[position])))
        if not isinstance(found, dict):
            raise EngineError(f"the teacher's prompt logprobs at position {position} lack the prompt's token")
        chosen[position] = clamped_logprob(found.get("logprob"))
        if ids is not None and logprobs is not None:
            ranked = sorted(
                ((int(value["rank"]), int(token), clamped_logprob(value["logprob"])) for token, value in entry.items()),
                key=lambda item: item[0],
            )[:topk]
            if len(ranked) < topk:
                raise EngineError(f"the teacher returned {len(ranked)} of the top-{topk} logprobs at {position}")
            ids[position] = [token for _, token, _ in ranked]
            logprobs[position] = [value for _, _, value in ranked]
    return chosen, ids, logprobs


def align(
    teacher: str,
    view: View,
    loss_weight: np.ndarray,
    chosen: np.ndarray,
    topk_ids: np.ndarray | None,
    topk_logprobs: np.ndarray | None,
) -> TeacherScores:
    """Back to the student's positions: a value on every trained token (weight > 0), NaN elsewhere."""
    trained = loss_weight > 0
    at = view.positions[trained]
    logprobs = np.full(len(loss_weight), np.nan, dtype=np.float32)
    logprobs[trained] = chosen[at]
    return TeacherScores(
        teacher=teacher,
        logprobs=logprobs,
        topk=None if topk_ids is None or topk_logprobs is None else TopLogprobs(topk_ids[at], topk_logprobs[at]),
        n_tokens_injected=view.n_tokens_injected,
    )


def view_spans(view: View, spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Image spans of the student's tokens (offset, length) at their place in ``view``: a fragment goes in at a
    turn boundary, never inside a span, so each span stays whole (a ``ValueError`` if one did not)."""
    placed = []
    for start, length in spans:
        first, last = int(view.positions[start]), int(view.positions[start + length - 1])
        if last - first != length - 1:
            raise ValueError(f"a teacher context was inserted inside the image span at {start}")
        placed.append((first, length))
    return tuple(placed)


def check_topk(topk: Any) -> int:
    if not isinstance(topk, int) or isinstance(topk, bool) or not 0 <= topk <= MAX_TOPK:
        raise InvalidRequest(f"topk must be an integer within [0, {MAX_TOPK}]", param="topk")
    return topk


async def score(
    teacher: str,
    scorer: PromptScorer,
    view: View,
    loss_weight: np.ndarray,
    *,
    topk: int,
    images: PromptImages | None = None,
) -> TeacherScores:
    """One engine call for the whole view; ``topk`` < 2 asks only for each token's own logprob; ``images``: the
    view's, when it holds any (spans placed by ``view_spans``)."""
    k = topk if topk >= 2 else 0
    entries = await scorer.prompt_logprobs(view.ids, k, images=images)
    chosen, ids, logprobs = read_prompt_logprobs(entries, view.ids, k)
    return align(teacher, view, loss_weight, chosen, ids, logprobs)
