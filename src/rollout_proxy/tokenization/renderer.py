"""Messages to tokens with the engine's own chat template, without re-rendering history.

A new turn's prompt is the parent's exact tokens, then *bridge tokens* for the new
messages, then the generation prompt. The bridge is cut out of a render of
``anchor + new messages``: the anchor is a tiny stand-in conversation ending with the
same role as the parent, and the cut falls right after the anchor's K-th end-of-turn
token, K being how many the anchor renders alone. Counting end-of-turn tokens
(rather than comparing prefixes) is what keeps this exact for templates that inject a
default system prompt or strip ``<think>`` from earlier assistant turns: those change
how the anchor is rendered, never how many turns it closes.

Every node's tokens end at an end-of-turn token (the template's trailing newline
belongs to the next bridge). A generated turn cut short by ``max_tokens`` has no
end-of-turn token, so its bridge starts with one (loss weight 0).

The renders come from a ``TemplateSource``: the engine's ``/tokenize`` (the vLLM client)
or the proxy's own tokenizer and template (``tokenization.local``); the logic here is the
same over both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import orjson

from rollout_proxy.bounded import BoundedCache
from rollout_proxy.errors import EngineError, MessagesMergeIntoParent
from rollout_proxy.wire.json_bytes import right_sized

ANCHOR_USER = "rollout-proxy anchor question"
ANCHOR_ASSISTANT = "rollout-proxy anchor answer"
ANCHOR_TOOL = "rollout-proxy anchor tool result"
ANCHOR_SYSTEM = "rollout-proxy anchor instructions"
_ANCHOR_CALL_ID = "call_rpanchor"
#: anchors rendered alone, by (role, tools, template kwargs): a job's few shapes, bounded as a cache
_MAX_CACHED_SHAPES = 1024
_MAX_CACHED_SHAPE_BYTES = 16 * 1024 * 1024


class TemplateSource(Protocol):
    """Messages and text to token ids with the model's chat template (vLLM's ``/tokenize`` semantics)."""

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray: ...

    async def tokenize_text(self, text: str) -> np.ndarray: ...

    async def detokenize(self, token_ids: Sequence[int]) -> str: ...


def anchor_conversation(last_role: str) -> list[dict[str, Any]]:
    """A stand-in history that ends with a message of ``last_role``."""
    user = {"role": "user", "content": ANCHOR_USER}
    if last_role == "assistant":
        return [user, {"role": "assistant", "content": ANCHOR_ASSISTANT}]
    if last_role == "tool":
        call = {"id": _ANCHOR_CALL_ID, "type": "function", "function": {"name": "anchor", "arguments": "{}"}}
        return [
            user,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": _ANCHOR_CALL_ID, "content": ANCHOR_TOOL},
        ]
    if last_role in ("system", "developer"):
        return [{"role": last_role, "content": ANCHOR_SYSTEM}]
    return [user]


def _find(haystack: np.ndarray, needle: np.ndarray) -> int:
    """Index of the last occurrence of ``needle`` in ``haystack``, or -1."""
    n = len(needle)
    if n == 0 or n > len(haystack):
        return -1
    windows = np.lib.stride_tricks.sliding_window_view(haystack, n)
    hits = np.flatnonzero((windows == needle).all(axis=1))
    return int(hits[-1]) if len(hits) else -1


def _nth_position(ids: np.ndarray, token: int, n: int) -> int:
    """Index of the n-th (1-based) occurrence of ``token`` in ``ids``, or -1."""
    hits = np.flatnonzero(ids == token)
    return int(hits[n - 1]) if len(hits) >= n else -1


def _cache_key(*parts: Any) -> bytes:
    return orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)


class ChatRenderer:
    """Renders with one chat template (one engine's); learns the template's shape once. ``leave_tools_out``:
    bridges render without the tools, for a template where a bridge is the same without them
    (``LocalTemplate.bridges_ignore``: decided once per template, whatever the tools); a harness's tools
    rendered in every bridge are most of its cost, for text the cut drops."""

    def __init__(self, source: TemplateSource, *, leave_tools_out: bool = False) -> None:
        self._source = source
        self.leaves_tools_out = leave_tools_out
        self._end_of_turn: int | None = None
        self._anchors: BoundedCache[bytes, np.ndarray] = BoundedCache(
            max_entries=_MAX_CACHED_SHAPES, max_bytes=_MAX_CACHED_SHAPE_BYTES
        )
        self._generation_prompts: BoundedCache[bytes, str] = BoundedCache(
            max_entries=_MAX_CACHED_SHAPES, max_bytes=_MAX_CACHED_SHAPE_BYTES
        )

    async def end_of_turn_id(self) -> int:
        """The token the template closes every message with (``<|im_end|>`` for ChatML)."""
        if self._end_of_turn is None:
            conversation = anchor_conversation("assistant")
            rendered = await self._source.tokenize_messages(
                conversation, tools=None, add_generation_prompt=False, chat_template_kwargs=None
            )
            answer = await self._source.tokenize_text(ANCHOR_ASSISTANT)
            at = _find(rendered, answer)
            if at < 0 or at + len(answer) >= len(rendered):
                raise EngineError("cannot find the end-of-turn token of the engine's chat template")
            self._end_of_turn = int(rendered[at + len(answer)])
        return self._end_of_turn

    async def generation_prompt_text(self, prompt_end: np.ndarray) -> str:
        """The text of what follows the last end-of-turn token of ``prompt_end`` (a turn's bridge, or a whole
        render): the generation prompt, whose text says whether the output starts inside a reasoning block.
        Decoded once per distinct token sequence (a template has one or two: with and without thinking)."""
        hits = np.flatnonzero(prompt_end == await self.end_of_turn_id())
        tail = prompt_end[int(hits[-1]) + 1 :] if len(hits) else prompt_end
        key = tail.astype(np.int32, copy=False).tobytes()
        text = self._generation_prompts.get(key)
        if text is None:
            text = await self._source.detokenize(tail.tolist())
            self._generation_prompts.put(key, text, size=len(key) + 2 * len(text) + 100, until=math.inf)
        return text

    async def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> np.ndarray:
        """A whole conversation (nothing of it generated by the policy yet)."""
        ids = await self._source.tokenize_messages(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return ids if add_generation_prompt else await self._close_at_last_turn(ids)

    async def bridge(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        after_role: str,
        after_closed: bool,
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> np.ndarray:
        """Tokens that follow a parent ending with a ``after_role`` message.

        ``after_closed`` says whether the parent's tokens end with the end-of-turn token.
        """
        if self.leaves_tools_out:
            tools = None
        end_of_turn = await self.end_of_turn_id()
        anchor = anchor_conversation(after_role)
        alone = await self._anchor_render(anchor, tools, chat_template_kwargs)
        turns = int(np.count_nonzero(alone == end_of_turn))
        rendered = await self._source.tokenize_messages(
            [*anchor, *messages],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        cut = _nth_position(rendered, end_of_turn, turns)
        if cut < 0:
            raise EngineError("the chat template closed fewer turns than expected while rendering new messages")
        if after_role != "assistant" and not np.array_equal(rendered[: cut + 1], alone):
            # A template may re-render an earlier assistant turn once more messages follow (Qwen3
            # drops its empty <think> block), which is why the cut counts turns. Other roles render
            # verbatim, so if the anchor changed, the template folded the new messages into the
            # parent's last turn (Qwen3 merges consecutive tool results). The parent's tokens are
            # fixed, so no bridge can be exact: refuse rather than drop or mis-render them.
            raise MessagesMergeIntoParent(
                f"the chat template renders these messages into the previous {after_role} turn (it merges them "
                f"with the messages before, as some templates do with consecutive tool results); that turn's "
                "tokens are already fixed, so send these messages together with the ones before them",
                param="messages",
            )
        if after_role == "assistant" and turns > 1:
            # The assistant turn itself may be re-rendered, never what comes before it: a template that moves
            # new messages in front of the history (vLLM merges every system message into the first one once
            # a developer message is converted) changes tokens the parent has fixed.
            head = _nth_position(alone, end_of_turn, turns - 1)
            if not np.array_equal(rendered[: head + 1], alone[: head + 1]):
                raise MessagesMergeIntoParent(
                    "the chat template renders these messages before the conversation's earlier turns (it merges "
                    "system and developer messages into the first one); those turns' tokens are already fixed, "
                    "so start a new conversation with these messages at its beginning",
                    param="messages",
                )
        bridge = rendered[cut + 1 :]
        if not add_generation_prompt:
            bridge = await self._close_at_last_turn(bridge)
        if not after_closed:
            bridge = np.concatenate([np.asarray([end_of_turn], dtype=np.int32), bridge])
        return bridge

    async def _anchor_render(
        self,
        anchor: list[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray:
        """The anchor rendered alone, up to its last end-of-turn token (cached per shape)."""
        key = _cache_key(anchor[-1]["role"], tools, chat_template_kwargs)
        alone = self._anchors.get(key)
        if alone is not None:
            return alone
        rendered = await self._source.tokenize_messages(
            anchor, tools=tools, add_generation_prompt=False, chat_template_kwargs=chat_template_kwargs
        )
        if not np.count_nonzero(rendered == await self.end_of_turn_id()):
            raise EngineError("the chat template closed no turn in a one-message conversation")
        alone = await self._close_at_last_turn(rendered)
        key = right_sized(key)  # kept: in a buffer of its own size (orjson's is far larger)
        self._anchors.put(key, alone, size=2 * len(key) + alone.nbytes + 200, until=math.inf)
        return alone

    async def _close_at_last_turn(self, ids: np.ndarray) -> np.ndarray:
        """Drop what follows the last end-of-turn token (it belongs to the next bridge)."""
        hits = np.flatnonzero(ids == await self.end_of_turn_id())
        return ids[: int(hits[-1]) + 1] if len(hits) else ids
