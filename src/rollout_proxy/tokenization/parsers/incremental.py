"""The assistant view of a turn as its text streams in: reasoning, content and tool calls, in pieces.

Only what the final parse (``OutputParser.parse`` of the whole text) is sure to contain is
released, so the pieces concatenate to exactly the non-streamed message:

- ``<think>`` reasoning streams once the text opened with ``<think>``, or from the first
  character when the turn's prompt left a ``<think>`` block open (``opened``: the proxy rendered
  the prompt, so it knows); a trailing newline or part of ``</think>`` waits for what follows.
  Text that does neither is content from its first character (only leading whitespace, or a
  prefix of ``<think>``, waits to see which it is).
- Content streams, except: a trailing whitespace run (stripped if a tool call follows), a
  suffix that may be the start of ``<tool_call>``, and content that starts with whitespace
  before any ``<tool_call>`` was seen (whether it is stripped depends on the rest).
- A hermes ``<tool_call>`` block is held until it closes; then it is released as one complete
  call, or, if it does not parse, as content (as the final parse keeps it).

``finish`` reconciles with the final parse: the rest of each field is released, and the final
view takes the ids of the calls already released. Parsers this module does not know are not
streamed: everything comes at ``finish``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rollout_proxy.tokenization.parsers import OutputParser
from rollout_proxy.tokenization.parsers.base import AssistantView, NoReasoning, NoTools
from rollout_proxy.tokenization.parsers.hermes import HermesToolParser
from rollout_proxy.tokenization.parsers.think import CLOSE, OPEN, ThinkReasoningParser

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(slots=True)
class ViewDelta:
    """What a piece of text adds to the assistant message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # complete calls, in order

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class IncrementalParser:
    """Feed the text as it comes (``feed``), then reconcile with the final parse (``finish``)."""

    def __init__(self, parser: OutputParser, *, opened: bool = False) -> None:
        """``opened``: the turn's prompt left a ``<think>`` block open (``ReasoningParser.opened_by``), as the
        final parse is told too."""
        self._parser = parser
        known_reasoning = isinstance(parser.reasoning, ThinkReasoningParser | NoReasoning)
        known_tools = isinstance(parser.tools, HermesToolParser | NoTools)
        self._hold_all = not (known_reasoning and known_tools)
        self._think = isinstance(parser.reasoning, ThinkReasoningParser)
        self._hermes = isinstance(parser.tools, HermesToolParser)
        self._in_reasoning = self._think
        self._prompt_opened = opened and self._think
        # reasoning phase (positions count characters of the phase's text, which is all the text fed)
        self._tail = ""  # the phase's text after the reasoning released so far: what the next piece may still need
        self._body_start = -1  # where the reasoning text starts (after <think> if any); -1: not known yet
        self._reasoning_end = -1  # end of the reasoning released so far
        # content phase
        self._strip_newlines = False  # drop the newlines right after </think>
        self._in_call = False
        self._pending = ""  # text not classified yet: a possible start of <tool_call>, or a call's last characters
        self._call: list[str] = []  # the open call's text before ``_pending``
        self._tag_seen = False
        self._held: list[str] = []  # content not released yet
        # released so far (pieces: a long turn is not copied at every chunk)
        self._reasoning: list[str] = []
        self._content_parts: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """All the text fed so far."""
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content_parts)

    # -- feeding ---------------------------------------------------------------------------------

    def feed(self, text: str) -> ViewDelta:
        delta = ViewDelta()
        self._text.append(text)
        if self._hold_all or not text:
            return delta
        if self._in_reasoning:
            text = self._feed_reasoning(text, delta)
            if self._in_reasoning:
                return delta
        self._feed_content(text, delta)
        return delta

    def _feed_reasoning(self, text: str, delta: ViewDelta) -> str:
        """Consume reasoning-phase text; returns what belongs to the content phase once it is known: what
        follows ``</think>``, or the whole text when it turns out to be a plain answer (else "").

        Only the phase's unreleased tail is kept as one string (what is released is dropped from it), so a
        long reasoning is not copied at every piece."""
        at = max(self._reasoning_end, 0)  # where ``_tail`` starts
        before = at + len(self._tail)  # the text before this piece holds no </think>, only maybe its start
        tail = self._tail = self._tail + text
        length = at + len(tail)
        if self._body_start < 0:  # nothing was dropped yet: ``tail`` is the whole phase
            stripped = tail.lstrip()
            if not stripped or OPEN.startswith(stripped):
                return ""  # only whitespace, or maybe the start of <think>: the next text tells
            if stripped.startswith(OPEN):
                self._body_start = len(tail) - len(stripped) + len(OPEN)
            elif self._prompt_opened:
                self._body_start = len(tail) - len(stripped)
            else:  # a plain answer (the prompt left no <think> open): all content, from its first character
                self._in_reasoning = False
                self._tail = ""
                return tail
        close = tail.find(CLOSE, max(0, before - len(CLOSE) + 1 - at))
        if close >= 0:
            whole = self.text  # the reasoning phase's text is all the text fed so far
            close += at + len(CLOSE)
            reasoning, _ = self._parser.reasoning.split(whole[:close], opened=self._prompt_opened)
            self._release_reasoning(reasoning or "", delta)
            self._in_reasoning = False
            self._strip_newlines = True
            self._tail = ""
            return whole[close:]
        start = self._reasoning_start(tail)
        if start < 0:
            return ""
        end = length - _partial_suffix(tail, CLOSE)
        while end > start and tail[end - at - 1] == "\n":
            end -= 1
        released = max(self._reasoning_end, start)
        if end > released:
            self._emit_reasoning(tail[released - at : end - at], delta)
            self._reasoning_end = end
        if self._reasoning_end > at:  # what is left is held: trailing newlines, a possible start of </think>
            self._tail = tail[self._reasoning_end - at :]
        return ""

    def _reasoning_start(self, tail: str) -> int:
        """Where the reasoning text begins: after ``<think>`` and the newlines after it (-1: only newlines yet).
        Until it is known, nothing was dropped from ``tail``."""
        if self._reasoning_end >= 0:
            return self._reasoning_end
        start = self._body_start
        while start < len(tail) and tail[start] == "\n":
            start += 1
        if start == len(tail):
            return -1
        self._reasoning_end = start
        return start

    def _release_reasoning(self, final: str, delta: ViewDelta) -> None:
        sent = self.reasoning
        if final.startswith(sent):
            self._emit_reasoning(final[len(sent) :], delta)

    def _emit_reasoning(self, text: str, delta: ViewDelta) -> None:
        if text:
            self._reasoning.append(text)
        delta.reasoning += text

    def _feed_content(self, text: str, delta: ViewDelta) -> None:
        if self._strip_newlines:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_newlines = False
        if not self._hermes:
            self._content_parts.append(text)
            delta.content += text
            return
        self._pending += text
        while True:
            if self._in_call:
                close = self._pending.find(CALL_CLOSE)
                if close < 0:  # an unfinished call is held back; only a possible </tool_call> stays unsearched
                    keep = len(CALL_CLOSE) - 1
                    if len(self._pending) > keep:
                        self._call.append(self._pending[:-keep])
                        self._pending = self._pending[-keep:]
                    return
                block = CALL_OPEN + "".join(self._call) + self._pending[: close + len(CALL_CLOSE)]
                self._call = []
                self._pending = self._pending[close + len(CALL_CLOSE) :]
                self._in_call = False
                _, calls, _ = self._parser.tools.extract(block)
                if calls:
                    self.tool_calls.extend(calls)
                    delta.tool_calls.extend(calls)
                else:
                    self._content(block, delta)  # malformed: it stays in the content, as the final parse keeps it
                continue
            start = self._pending.find(CALL_OPEN)
            if start >= 0:
                self._tag_seen = True
                self._content(self._pending[:start], delta)
                self._pending = self._pending[start + len(CALL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._pending, CALL_OPEN)
            self._content(self._pending[: len(self._pending) - keep], delta)
            self._pending = self._pending[len(self._pending) - keep :]
            return

    def _content(self, text: str, delta: ViewDelta) -> None:
        """Release content that no later text can change (see the module docstring)."""
        if not self._content_parts and not self._tag_seen and (self._held or text[:1].isspace()):
            self._held.append(text)  # content that starts with whitespace: stripped or not, only the rest tells
            return
        held = "".join(self._held) + text
        if not self._content_parts and self._tag_seen:
            held = held.lstrip()  # with calls the content is stripped
        released = held.rstrip()
        self._held = [held[len(released) :]] if len(released) < len(held) else []
        if released:
            self._content_parts.append(released)
        delta.content += released

    # -- the end -----------------------------------------------------------------------------------

    def finish(self, final: AssistantView) -> tuple[AssistantView, ViewDelta, bool]:
        """The rest of the message, given the final parse of the whole text: (the view to record, with the
        released calls' ids; what is left to release; whether the released pieces agree with it)."""
        delta = ViewDelta()
        agrees = True
        reasoning = final.reasoning or ""
        content = final.content or ""
        sent_reasoning, sent_content = self.reasoning, self.content
        if reasoning.startswith(sent_reasoning):
            delta.reasoning = reasoning[len(sent_reasoning) :]
        else:
            agrees = False
        if content.startswith(sent_content):
            delta.content = content[len(sent_content) :]
        else:
            agrees = False
        calls = [dict(call) for call in final.tool_calls]
        released = len(self.tool_calls)
        if [c["function"] for c in calls[:released]] != [c["function"] for c in self.tool_calls]:
            agrees = False
        for call, sent in zip(calls, self.tool_calls, strict=False):
            call["id"] = sent["id"]  # the client has these ids already
        delta.tool_calls = calls[released:]
        self._reasoning.append(delta.reasoning)
        self._content_parts.append(delta.content)
        self.tool_calls.extend(delta.tool_calls)
        return dataclasses.replace(final, tool_calls=calls), delta, agrees
