"""The tokens a new node adds: a whole render at the root, else a bridge after its parent.

One ``ChatRenderer`` per engine (it learns that engine's template once); whether the
parent's tokens are already closed decides if the bridge starts with an end-of-turn
token (a turn cut by ``max_tokens`` is not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_proxy.core.tree import Placement
from rollout_proxy.engines.base import Engine
from rollout_proxy.records import NodeKind
from rollout_proxy.tokenization.renderer import ChatRenderer


class Renderers:
    def __init__(self) -> None:
        self._by_engine: dict[str, ChatRenderer] = {}

    def of(self, engine: Engine) -> ChatRenderer:
        renderer = self._by_engine.get(engine.url)
        if renderer is None:
            renderer = self._by_engine[engine.url] = ChatRenderer(engine)
        return renderer

    async def delta(
        self,
        engine: Engine,
        placement: Placement,
        *,
        tools: Sequence[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> np.ndarray:
        """Tokens for ``placement``'s new messages (and the generation prompt when asked)."""
        renderer = self.of(engine)
        messages = placement.new_messages
        if not placement.parent:
            return await renderer.render(
                messages,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
            )
        last = placement.parent[-1]
        closed = last.kind is NodeKind.INJECTED or (
            len(last.output_ids) > 0 and int(last.output_ids[-1]) == await renderer.end_of_turn_id()
        )
        return await renderer.bridge(
            messages,
            after_role=last.messages[-1]["role"],
            after_closed=closed,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
        )
