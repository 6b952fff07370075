"""Parsers of generated text, selectable per server by name."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_proxy.tokenization.parsers.base import (
    AssistantView,
    NoReasoning,
    NoTools,
    ReasoningParser,
    ToolParse,
    ToolParser,
)
from rollout_proxy.tokenization.parsers.hermes import HermesToolParser
from rollout_proxy.tokenization.parsers.think import ThinkReasoningParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "none": NoTools}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "think": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
    "none": NoReasoning,
}


@dataclass(frozen=True, slots=True)
class OutputParser:
    """Reasoning first, then tool calls in what remains."""

    reasoning: ReasoningParser
    tools: ToolParser

    @classmethod
    def named(cls, tool_parser: str, reasoning_parser: str) -> OutputParser:
        try:
            tools = TOOL_PARSERS[tool_parser]()
        except KeyError:
            raise ValueError(f"unknown tool parser {tool_parser!r}; choose from {sorted(TOOL_PARSERS)}") from None
        try:
            reasoning = REASONING_PARSERS[reasoning_parser]()
        except KeyError:
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r}; choose from {sorted(REASONING_PARSERS)}"
            ) from None
        return cls(reasoning=reasoning, tools=tools)

    @property
    def reasons(self) -> bool:
        """Whether reasoning is parsed at all (``--reasoning-parser none``: never)."""
        return not isinstance(self.reasoning, NoReasoning)

    def parse(self, text: str, *, opened: bool = False) -> AssistantView:
        """``opened``: the turn's prompt left a reasoning block open (``reasoning.opened_by``)."""
        reasoning, rest = self.reasoning.split(text, opened=opened)
        text_part, calls, outcome = self.tools.extract(rest)
        content = None if not text_part and calls else text_part  # a bare tool call has no content
        return AssistantView(content=content, reasoning=reasoning, tool_calls=calls, tool_parse=outcome)


__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "AssistantView", "OutputParser", "ToolParse"]
