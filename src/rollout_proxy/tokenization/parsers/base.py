"""Parsers turn generated text into the assistant message a client sees.

The message is only a *view*: the tokens the engine sampled are what the trainer
gets, whatever a parser makes of them. Parsers are pure functions of the text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


class ToolParse(str, enum.Enum):
    """How tool-call extraction ended, so a parser that never fires is visible."""

    NO_CALLS = "no_calls"
    CALLS = "calls"
    MALFORMED = "malformed"  # something looked like a call but did not parse; kept as text


@dataclass(slots=True)
class AssistantView:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_parse: ToolParse = ToolParse.NO_CALLS

    def message(self) -> dict[str, Any]:
        """The normalized assistant message, as stored in the node."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        return message


class ReasoningParser(Protocol):
    def opened_by(self, generation_prompt: str) -> bool:
        """Whether the output of a prompt that ends with ``generation_prompt`` (the text after the prompt's
        last end-of-turn token) starts inside reasoning."""
        ...

    def split(self, text: str, *, opened: bool = False) -> tuple[str | None, str]:
        """(reasoning, the rest of the text); ``opened``: what ``opened_by`` said of the turn's prompt."""
        ...


class ToolParser(Protocol):
    def extract(self, text: str) -> tuple[str, list[dict[str, Any]], ToolParse]:
        """(text without the calls, the calls in OpenAI form, outcome)."""
        ...


class NoReasoning:
    def opened_by(self, generation_prompt: str) -> bool:
        return False

    def split(self, text: str, *, opened: bool = False) -> tuple[str | None, str]:
        return None, text


class NoTools:
    def extract(self, text: str) -> tuple[str, list[dict[str, Any]], ToolParse]:
        return text, [], ToolParse.NO_CALLS
