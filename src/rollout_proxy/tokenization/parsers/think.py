"""``<think>…</think>`` reasoning, as Qwen3 and DeepSeek-R1 style models emit it.

Whether the output starts inside a ``<think>`` block is not guessed from the output: the
proxy rendered the prompt, so it knows whether the generation prompt left one open
(``opened_by``: templates that put ``<think>`` in the generation prompt, as DeepSeek-R1's
and Qwen3's thinking variants do). Then the text is reasoning up to ``</think>``. Otherwise
only text that opens with ``<think>`` has reasoning; a plain answer is all content, from its
first character. An unterminated block (generation cut by ``max_tokens``) is all reasoning.
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"


class ThinkReasoningParser:
    def opened_by(self, generation_prompt: str) -> bool:
        """Whether a prompt ending with ``generation_prompt`` leaves a ``<think>`` block open."""
        return generation_prompt.rfind(OPEN) > generation_prompt.rfind(CLOSE)

    def split(self, text: str, *, opened: bool = False) -> tuple[str | None, str]:
        """(reasoning, the rest); ``opened``: the prompt left a ``<think>`` block open (``opened_by``)."""
        stripped = text.lstrip()
        if not opened and not stripped.startswith(OPEN):
            return None, text
        if CLOSE in text:
            reasoning, rest = text.split(CLOSE, 1)
            return reasoning.lstrip().removeprefix(OPEN).strip("\n") or None, rest.lstrip("\n")
        return stripped.removeprefix(OPEN).strip("\n") or None, ""
