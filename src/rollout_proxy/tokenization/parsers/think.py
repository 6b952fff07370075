"""``<think>…</think>`` reasoning, as Qwen3 and DeepSeek-R1 style models emit it.

The opening tag may be missing (templates that put it in the generation prompt);
an unterminated block (generation cut by ``max_tokens``) is all reasoning.
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"


class ThinkReasoningParser:
    def split(self, text: str) -> tuple[str | None, str]:
        if CLOSE in text:
            reasoning, rest = text.split(CLOSE, 1)
            reasoning = reasoning.lstrip()
            reasoning = reasoning.removeprefix(OPEN)
            return reasoning.strip("\n") or None, rest.lstrip("\n")
        stripped = text.lstrip()
        if stripped.startswith(OPEN):
            return stripped.removeprefix(OPEN).strip("\n") or None, ""
        return None, text
