"""A scripted engine in the test's own process: no socket, no tokenizer files, no template engine.

For the core's unit tests (``core.turns``, ``core.streaming``, ``core.rendering`` over an engine): it
implements the whole ``Engine`` protocol in a few lines. Its tokenizer is a toy one (every word, run of
spaces, newline and mark is one id, numbered as first seen; ``<|im_start|>`` is 1, ``<|im_end|>`` 2),
its chat template a ChatML one (``<|im_start|>role\\ncontent<|im_end|>\\n``, the generation prompt
``<|im_start|>assistant\\n``, plus ``generation_prompt_suffix`` when given: ``"<think>\\n"`` opens a
reasoning block), and its replies are scripted.

A reply can be sampled **as other tokens than the toy tokenizer would give its text** (``split=True``:
one id per character): the text is the same, the ids are not, so a proxy that re-tokenized what the
policy generated would send a prompt the engine never produced. The wire-format double (an HTTP server
speaking vLLM's format with the real tokenizer) is ``devtools.fake_engine``; this one is for logic.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_proxy.engines.base import CompletionPiece, EngineCompletion, EngineInfo, PieceSink, SamplingParams

START, END = "<|im_start|>", "<|im_end|>"
_PIECES = re.compile(r"<\|im_start\|>|<\|im_end\|>|\n| +|\w+|[^\w\s]")


@dataclass
class Scripted:
    """One scripted reply: its text, and whether it is sampled one character per token."""

    text: str
    split: bool = False


@dataclass
class ScriptedEngine:
    url: str = "scripted://engine"
    model: str = "scripted-model"
    max_model_len: int = 4096
    generation_prompt_suffix: str = ""
    returns_routing: bool | None = False
    replies: list[Scripted] = field(default_factory=list)
    #: what each complete() was given: (prompt ids, sampling params)
    calls: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    #: what each complete() sampled
    sampled: list[list[int]] = field(default_factory=list)
    echo: bool = True  # report the prompt consumed (vLLM's return_token_ids)
    on_complete: Callable[[], None] | None = None
    _ids: dict[str, int] = field(default_factory=lambda: {START: 1, END: 2})

    # -- the toy tokenizer -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        pieces = _PIECES.findall(text)
        assert "".join(pieces) == text, f"the toy tokenizer cannot spell {text!r}"
        return [self._ids.setdefault(piece, len(self._ids) + 1) for piece in pieces]

    def decode(self, ids: Sequence[int]) -> str:
        by_id = {number: piece for piece, number in self._ids.items()}
        return "".join(by_id[int(number)] for number in ids)

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        text = ""
        for message in messages:
            content = message.get("content") or ""
            for call in message.get("tool_calls") or ():
                content += f"<tool_call>{call['function']['name']} {call['function']['arguments']}</tool_call>"
            text += f"{START}{message['role']}\n{content}{END}\n"
        if add_generation_prompt:
            text += f"{START}assistant\n{self.generation_prompt_suffix}"
        return text

    def queue(self, *replies: str | Scripted) -> None:
        self.replies += [reply if isinstance(reply, Scripted) else Scripted(reply) for reply in replies]

    # -- generation -----------------------------------------------------------------------------------------

    async def info(self) -> EngineInfo:
        return EngineInfo(url=self.url, model=self.model, max_model_len=self.max_model_len)

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray:
        return np.asarray(self.encode(self.render(messages, add_generation_prompt=add_generation_prompt)), np.int32)

    async def tokenize_text(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.decode(token_ids)

    async def complete(
        self,
        prompt_ids: np.ndarray,
        params: SamplingParams,
        *,
        on_sent: Callable[[], None] | None = None,
        sink: PieceSink | None = None,
    ) -> EngineCompletion:
        self.calls.append((prompt_ids.tolist(), params))
        if on_sent is not None:
            on_sent()
        if self.on_complete is not None:
            self.on_complete()
        reply = self.replies.pop(0) if self.replies else Scripted("Scripted answer.")
        ids = [self._ids.setdefault(char, len(self._ids) + 1) for char in reply.text] if reply.split else None
        ids = (ids if ids is not None else self.encode(reply.text))[: max(params.max_tokens - 1, 0)]
        ids.append(self._ids[END])
        self.sampled.append(ids)
        logprobs = np.asarray([-0.125 * (index % 5 + 1) for index in range(len(ids))], dtype=np.float32)
        text = self.decode(ids[:-1])
        if sink is not None:
            await sink.begin(prompt_ids)
            for index, token in enumerate(ids):
                piece_text = self.decode([token]) if token != self._ids[END] else ""
                await sink.piece(
                    CompletionPiece(np.asarray([token], np.int32), logprobs[index : index + 1], piece_text)
                )
        return EngineCompletion(
            prompt_ids=prompt_ids.copy() if self.echo else None,
            output_ids=np.asarray(ids, dtype=np.int32),
            output_logprobs=logprobs,
            text=text,
            finish_reason="stop",
        )

    # -- control: always well -------------------------------------------------------------------------------

    async def healthy(self) -> bool:
        return True

    async def health(self) -> None:
        return None

    async def weight_version(self) -> str | None:
        return None

    async def update_weight_version(self, version: str, *, within: float) -> bool:
        return False

    async def pause(self, mode: str, *, within: float) -> None:
        return None

    async def resume(self, *, within: float) -> None:
        return None

    async def is_paused(self) -> bool | None:
        return None

    async def close(self) -> None:
        return None
