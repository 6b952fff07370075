"""Is local rendering the engine's? Canonical conversations rendered both ways, token for token.

The set covers what turns render: a system prompt, developer messages (a harness's prompt), tools, tool
calls and their results
(two in a row: Qwen-style templates merge them), ``<think>`` reasoning in earlier turns
(templates strip it), several turns, both generation-prompt settings, a
``chat_template_kwargs`` (``enable_thinking``), non-ASCII text, and the renderer's own
anchor conversations with new messages after them (what every bridge is cut from).
A case the template refuses must be refused on both sides; a case rendered on one side
only, or into other tokens, is a mismatch, reported as a ``TokenDiff``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np

from rollout_proxy.errors import EngineError, InvalidRequest, TemplateRenderError
from rollout_proxy.tokenization.local import LocalTemplate
from rollout_proxy.tokenization.renderer import ANCHOR_ASSISTANT, ChatRenderer, TemplateSource, anchor_conversation

#: ids shown on each side of the first difference in a logged diff
DIFF_WINDOW = 8

_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
_CLOCK = {
    "type": "function",
    "function": {
        "name": "local_time",
        "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [_WEATHER, _CLOCK]

_SYSTEM = {"role": "system", "content": "You are a careful assistant.\nAnswer in one or two sentences."}
_USER = {"role": "user", "content": "What's the weather in Paris, and what time is it there?"}
_CALLS = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {
            "id": "call_t",
            "type": "function",
            "function": {"name": "local_time", "arguments": '{"zone": "Europe/Paris"}'},
        },
    ],
}
_RESULTS = [
    {"role": "tool", "tool_call_id": "call_w", "content": '{"temp": 18, "sky": "light rain"}'},
    {"role": "tool", "tool_call_id": "call_t", "content": "14:05"},
]
_THOUGHT = {
    "role": "assistant",
    "content": "<think>\nRain at 18°C: an umbrella helps.\n</think>\n\nIt is 18°C with light rain, and 14:05.",
}
_FOLLOW_UP = {"role": "user", "content": "And in Tōkyō? Answer with an emoji too 🌧️"}
_SECOND = {"role": "assistant", "content": "<think>\nNo tool needed.\n</think>\n\nI cannot tell without a tool ☂️"}
_LAST = {"role": "user", "content": "Thanks!  Bye."}
#: a harness's prompt (Codex: two developer messages, then the user's turns)
_DEVELOPER = {"role": "developer", "content": "You are a coding agent.\nRun commands with the tools given."}
_SKILLS = {"role": "developer", "content": "<skills>\nNone installed.\n</skills>"}


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def canonical_cases() -> list[Case]:
    """Every case is rendered with and without the generation prompt."""
    cases = [
        Case("system_user", [_SYSTEM, _USER]),
        Case("user_only", [_USER]),
        Case("tool_round_trip", [_SYSTEM, _USER, _CALLS, *_RESULTS, _THOUGHT, _FOLLOW_UP], tools=TOOLS),
        Case("several_turns_with_think", [_USER, _THOUGHT, _FOLLOW_UP, _SECOND, _LAST]),
        Case("thinking_off", [_SYSTEM, _USER], chat_template_kwargs={"enable_thinking": False}),
        Case("thinking_on", [_USER, _THOUGHT, _FOLLOW_UP], tools=TOOLS, chat_template_kwargs={"enable_thinking": True}),
        Case("developer_prompt", [_DEVELOPER, _SKILLS, _USER, _FOLLOW_UP], tools=TOOLS),
        Case("system_and_developer", [_SYSTEM, _DEVELOPER, _USER]),
    ]
    for role in ("user", "assistant", "tool", "system", "developer"):
        anchor = anchor_conversation(role)
        cases.append(Case(f"anchor_{role}", anchor, tools=TOOLS))
        cases.append(Case(f"anchor_{role}_then_user", [*anchor, _FOLLOW_UP]))
    cases.append(Case("anchor_tool_then_tool", [*anchor_conversation("tool"), _RESULTS[1]], tools=TOOLS))
    return cases


#: (the role a parent ends with, the new messages) of the bridges ``bridge_check`` renders with and without tools
BRIDGES = (
    ("user", [_CALLS]),
    ("assistant", [_FOLLOW_UP]),
    ("assistant", [*_RESULTS]),
    ("tool", [_RESULTS[1], _FOLLOW_UP]),
    ("tool", [_THOUGHT, _LAST]),
    ("system", [_USER]),
    ("developer", [_SKILLS, _USER]),
)


CHECKED_TEXTS = (ANCHOR_ASSISTANT, _FOLLOW_UP["content"], "  two  spaces\n\nand <|im_end|> inside")


@dataclass(frozen=True, slots=True)
class TokenDiff:
    """Where two renders of one case part: what a log line shows."""

    case: str
    position: int  # first index where the ids differ (the shorter length if one is a prefix)
    local_len: int
    engine_len: int
    local_ids: list[int]  # a window around ``position``
    engine_ids: list[int]
    local_tokens: list[str]
    engine_tokens: list[str]
    window_start: int
    note: str = ""  # e.g. one side refused the case

    def log_fields(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "first_difference": self.position,
            "window_start": self.window_start,
            "local_len": self.local_len,
            "engine_len": self.engine_len,
            "local_ids": self.local_ids,
            "engine_ids": self.engine_ids,
            "local_tokens": self.local_tokens,
            "engine_tokens": self.engine_tokens,
            **({"note": self.note} if self.note else {}),
        }


@overload
def token_diff(
    case: str, local: np.ndarray, engine: np.ndarray, template: LocalTemplate, *, force: Literal[True]
) -> TokenDiff: ...
@overload
def token_diff(
    case: str, local: np.ndarray, engine: np.ndarray, template: LocalTemplate, *, force: bool = False
) -> TokenDiff | None: ...
def token_diff(
    case: str, local: np.ndarray, engine: np.ndarray, template: LocalTemplate, *, force: bool = False
) -> TokenDiff | None:
    """None if the ids are equal (unless ``force``), else the first difference with a window of ids
    and their token strings on both sides."""
    if not force and np.array_equal(local, engine):
        return None
    n = min(len(local), len(engine))
    differs = np.flatnonzero(local[:n] != engine[:n])
    position = int(differs[0]) if len(differs) else n
    start = max(0, position - DIFF_WINDOW)
    ours = [int(i) for i in local[start : position + DIFF_WINDOW]]
    theirs = [int(i) for i in engine[start : position + DIFF_WINDOW]]
    return TokenDiff(
        case=case,
        position=position,
        local_len=len(local),
        engine_len=len(engine),
        local_ids=ours,
        engine_ids=theirs,
        local_tokens=template.token_strs(ours),
        engine_tokens=template.token_strs(theirs),
        window_start=start,
    )


@dataclass(slots=True)
class CheckReport:
    rendered: int = 0  # cases both sides rendered to the same ids
    refused: int = 0  # cases both sides refused
    diffs: list[TokenDiff] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.diffs and self.rendered > 0


async def _engine_outcome(engine: TemplateSource, case: Case, add_generation_prompt: bool) -> np.ndarray | str:
    """The ids, or the refusal's message when the template refuses the case."""
    try:
        return await engine.tokenize_messages(
            case.messages,
            tools=case.tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=case.chat_template_kwargs,
        )
    except TemplateRenderError as exc:
        return exc.message


def _local_outcomes(local: LocalTemplate, jobs: Sequence[tuple[Case, bool]]) -> list[np.ndarray | str]:
    """Every case rendered locally (blocking: run in a thread, tens of renders)."""
    outcomes: list[np.ndarray | str] = []
    for case, flag in jobs:
        try:
            outcomes.append(
                local.render_ids(
                    case.messages,
                    tools=case.tools,
                    add_generation_prompt=flag,
                    chat_template_kwargs=case.chat_template_kwargs,
                )
            )
        except TemplateRenderError as exc:
            outcomes.append(exc.message)
    return outcomes


def _compare(
    name: str, local_result: np.ndarray | str, engine_result: np.ndarray | str, local: LocalTemplate
) -> tuple[str, TokenDiff | None]:
    """("rendered" | "refused" | "mismatch", the diff of a mismatch); "refused" means by both sides."""
    if isinstance(local_result, str) and isinstance(engine_result, str):
        return "refused", None
    if isinstance(local_result, str) or isinstance(engine_result, str):
        refused_by, message = ("local", local_result) if isinstance(local_result, str) else ("engine", engine_result)
        ours = np.zeros(0, dtype=np.int32) if isinstance(local_result, str) else local_result
        theirs = np.zeros(0, dtype=np.int32) if isinstance(engine_result, str) else engine_result
        forced = token_diff(name, ours, theirs, local, force=True)
        return "mismatch", dataclasses.replace(forced, note=f"only the {refused_by} side refused: {str(message)[:200]}")
    diff = token_diff(name, local_result, engine_result, local)
    return ("rendered", None) if diff is None else ("mismatch", diff)


async def self_check(local: LocalTemplate, engine: TemplateSource, cases: Sequence[Case] | None = None) -> CheckReport:
    """Render every case locally (in a thread) and through ``engine`` (concurrently); engine
    errors other than a template refusal propagate (the check is then not done)."""
    jobs = [(case, flag) for case in (canonical_cases() if cases is None else cases) for flag in (True, False)]
    ours_task = asyncio.create_task(asyncio.to_thread(_local_outcomes, local, jobs))
    try:
        theirs = await asyncio.gather(*(_engine_outcome(engine, case, flag) for case, flag in jobs))
        engine_texts = await asyncio.gather(*(engine.tokenize_text(text) for text in CHECKED_TEXTS))
    finally:
        ours = await ours_task
    report = CheckReport()
    for (case, flag), local_result, engine_result in zip(jobs, ours, theirs, strict=True):
        name = f"{case.name}/{'generation_prompt' if flag else 'no_generation_prompt'}"
        outcome, diff = _compare(name, local_result, engine_result, local)
        if diff is not None:
            report.diffs.append(diff)
        elif outcome == "rendered":
            report.rendered += 1
        else:
            report.refused += 1
    for index, (text, engine_ids) in enumerate(zip(CHECKED_TEXTS, engine_texts, strict=True)):
        text_diff = token_diff(f"text_{index}", local.encode(text), engine_ids, local)
        if text_diff is not None:
            report.diffs.append(text_diff)
    return report


async def canonical_bridges(renderer: ChatRenderer) -> list[tuple[str, np.ndarray | str]]:
    """``BRIDGES`` rendered by ``renderer``, with ``TOOLS``, with and without the generation prompt, after a
    closed parent: (the case's name, its ids or the refusal's words)."""
    rendered: list[tuple[str, np.ndarray | str]] = []
    for role, messages in BRIDGES:
        for flag in (True, False):
            name = f"bridge_after_{role}_{len(messages)}/{'generation_prompt' if flag else 'no_generation_prompt'}"
            try:
                ids = await renderer.bridge(
                    messages,
                    after_role=role,
                    after_closed=True,
                    tools=TOOLS,
                    chat_template_kwargs=None,
                    add_generation_prompt=flag,
                )
            except (InvalidRequest, EngineError) as exc:  # refused, or the template's shape not learnt
                rendered.append((name, exc.message))
            else:
                rendered.append((name, ids))
    return rendered


async def bridge_check(local: LocalTemplate) -> list[TokenDiff]:
    """The canonical bridges (``canonical_bridges``) rendered with the tools and with them left out where
    ``local.bridges_ignore`` says they change nothing: the differences (a template whose syntax
    ``tokenization.tools_head`` read wrong). Local only; the self-check compares the whole renders these are
    cut from with the engine's."""
    if not local.bridges_ignore(TOOLS):
        return []
    left_out = await canonical_bridges(ChatRenderer(local, leave_tools_out=True))
    rendered = await canonical_bridges(ChatRenderer(local))
    diffs = []
    for (name, ours), (_, theirs) in zip(left_out, rendered, strict=True):
        _, diff = _compare(name, ours, theirs, local)
        if diff is not None:
            diffs.append(dataclasses.replace(diff, note=f"{diff.note} (left: tools left out; right: rendered)"))
    return diffs
