"""``developer`` messages are rendered, never dropped: Codex's whole system prompt is two of them.

vLLM 0.32 hands a template that never names the developer role its developer messages as system ones
(``vllm_chat.developer_as_system``), and so does the local renderer. An engine that hands them over as
sent (older vLLMs, other servers) to a template without a developer branch drops them without a word.
``DeveloperRole`` wraps an engine's renders: the first time a conversation has a developer message, it
asks the engine once whether a developer message's content reaches the tokens (two one-message renders
that differ only in that content must differ), and where it does not, sends developer messages as vLLM
0.32 would hand them to the template. The self-check (``tokenization.selfcheck``) compares the local
renderer with the engine through this wrapper, on conversations with developer messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from rollout_proxy.errors import TemplateRenderError
from rollout_proxy.tokenization.renderer import ANCHOR_USER, TemplateSource
from rollout_proxy.tokenization.vllm_chat import developer_as_system

log = structlog.get_logger(__name__)

_PROBES = ("rollout-proxy developer probe: alpha", "rollout-proxy developer probe: omega")


class DeveloperRole:
    """A ``TemplateSource`` whose developer messages always reach the tokens (see the module docstring)."""

    def __init__(self, source: TemplateSource, *, name: str = "") -> None:
        self._source = source
        self._name = name
        self._renders: bool | None = None

    async def renders_developer(self) -> bool:
        """Whether the source renders a developer message's content (asked once; an engine failure is raised
        and asked again next time)."""
        if self._renders is None:
            renders = []
            for probe in _PROBES:
                conversation = [{"role": "developer", "content": probe}, {"role": "user", "content": ANCHOR_USER}]
                try:
                    renders.append(
                        await self._source.tokenize_messages(
                            conversation, tools=None, add_generation_prompt=False, chat_template_kwargs=None
                        )
                    )
                except TemplateRenderError:  # the template refuses the role: it cannot be rendered as sent
                    renders = []
                    break
            self._renders = len(renders) == 2 and not np.array_equal(renders[0], renders[1])
            if not self._renders:
                log.info("developer_as_system", engine=self._name, reason="the template drops developer messages")
        return self._renders

    async def tokenize_messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> np.ndarray:
        if any(message["role"] == "developer" for message in messages) and not await self.renders_developer():
            messages = developer_as_system(messages)
        return await self._source.tokenize_messages(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )

    async def tokenize_text(self, text: str) -> np.ndarray:
        return await self._source.tokenize_text(text)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self._source.detokenize(token_ids)
