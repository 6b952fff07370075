"""The engine interface: token ids in, token ids (and their logprobs) out.

The proxy never sends text to generate from: ``complete`` takes the exact prompt
token ids, and the chat template is only used, through ``tokenize_messages``, to
render the messages the policy did not generate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None = None
    stop: tuple[str, ...] = ()
    routed_experts_prompt_start: int | None = None  # only for engines that return routing


@dataclass(frozen=True, slots=True)
class EngineInfo:
    url: str
    model: str
    max_model_len: int


@dataclass(slots=True)
class EngineCompletion:
    prompt_ids: np.ndarray | None  # what the engine says it consumed (None if not reported)
    output_ids: np.ndarray  # int32
    output_logprobs: np.ndarray  # float32, the sampled tokens' logprobs
    text: str
    finish_reason: str
    nonfinite_logprobs: int = 0  # how many logprobs were NaN/inf and clamped
    routed_experts: str | None = None  # the engine's encoded routing, decoded by routing/


class Engine(Protocol):
    """One inference engine (a vLLM server, or the fake one in tests)."""

    url: str
    #: whether completions carry MoE routing; None until the first completion tells
    returns_routing: bool | None

    async def info(self) -> EngineInfo: ...

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray: ...

    async def tokenize_text(self, text: str) -> np.ndarray: ...

    async def complete(self, prompt_ids: np.ndarray, params: SamplingParams) -> EngineCompletion: ...

    async def healthy(self) -> bool: ...

    async def close(self) -> None: ...
