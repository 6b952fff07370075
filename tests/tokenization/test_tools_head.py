"""Bridges leave the tools out only where the template reads them in its head alone (``tokenization.tools_head``).

Templates in the shapes the field has: the tools in the system turn (Qwen), in the first user message (Llama
3.1), before the last user message (Mistral), after the conversation; and the ways a head can reach past the
first message. Each verdict is checked against renders: where the answer is yes, every canonical bridge is
the same token for token with the tools left out; where it is no, leaving them out changes some bridge, so a
wrong yes would have recorded wrong tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rollout_proxy.tokenization.local import LocalTemplate
from rollout_proxy.tokenization.renderer import ChatRenderer
from rollout_proxy.tokenization.selfcheck import TOOLS, bridge_check, canonical_bridges
from rollout_proxy.tokenization.tools_head import tools_only_shape_the_head
from tests.conftest import TEMPLATES

#: the turns after a head that renders the first message when it is a system one
TURNS = """{%- for m in messages -%}
{%- if not (loop.first and m.role == 'system') -%}
<|im_start|>{{ m.role }}
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
#: no tools at all: every message rendered in the turns
NO_TOOLS = TURNS.replace("{%- if not (loop.first and m.role == 'system') -%}", "{%- if true -%}")

#: the tools in the system turn, before any message past the first (Qwen's shape)
IN_THE_SYSTEM_TURN = (
    """{%- if tools -%}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}Tools:{% for t in tools %}
{{ t | tojson }}{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' -%}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}"""
    + TURNS
)
#: Llama 3.1's shape: the tools inside the first user message
IN_THE_FIRST_USER_MESSAGE = """{%- set ns = namespace(done=false) -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.role == 'user' and tools and not ns.done %}{% set ns.done = true %}Tools: {{ tools | tojson }}
{% endif %}{{ m.content or '' }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
#: Mistral's shape: the tools right before the last user message
BEFORE_THE_LAST_USER_MESSAGE = """{%- for m in messages -%}
{%- if m.role == 'user' and loop.last and tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif -%}
<|im_start|>{{ m.role }}
{{ m.content or '' }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""
#: the tools after the conversation, before the generation prompt
AFTER_THE_CONVERSATION = TURNS.replace(
    "{%- if add_generation_prompt", "{%- if tools %}Tools: {{ tools | tojson }}{% endif -%}{%- if add_generation_prompt"
)
#: a head that reads the last message
HEAD_READS_THE_LAST_MESSAGE = (
    """{%- if tools -%}<|im_start|>system
Tools for {{ messages[-1].role }}: {{ tools | tojson }}<|im_end|>
{% endif -%}"""
    + TURNS
)
#: a head that sets a name the turns read
HEAD_SETS_A_NAME = """{%- if tools -%}{%- set listed = tools | length -%}<|im_start|>system
{{ tools | tojson }}<|im_end|>
{% endif -%}""" + TURNS.replace(
    "{{ m.content or '' }}", "{{ m.content or '' }}{% if listed is defined %} ({{ listed }}){% endif %}"
)
#: a macro that reads the tools, called by the turns
MACRO_READS_THE_TOOLS = """{%- macro names() -%}{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{%- endmacro -%}
{%- if tools -%}<|im_start|>system
{{ tools | tojson }}<|im_end|>
{% endif -%}""" + TURNS.replace("{{ m.content or '' }}", "{{ m.content or '' }}{{ names() }}")
#: a head that calls a macro reading the conversation
HEAD_CALLS_A_MACRO_READING_MESSAGES = (
    """{%- macro count() -%}{{ messages | length }}{%- endmacro -%}
{%- if tools -%}<|im_start|>system
{{ count() }} messages; {{ tools | tojson }}<|im_end|>
{% endif -%}"""
    + TURNS
)
#: a head that reads a namespace the conversation filled
HEAD_READS_A_NAMESPACE = (
    """{%- set ns = namespace(users=0) -%}{%- for m in messages %}{% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}{% endfor -%}
{%- if tools -%}<|im_start|>system
{{ ns.users }} users; {{ tools | tojson }}<|im_end|>
{% endif -%}"""
    + TURNS
)

HEAD_ONLY = {"qwen3_style": TEMPLATES["qwen3_style"], "in_the_system_turn": IN_THE_SYSTEM_TURN, "no_tools": NO_TOOLS}
NOT_HEAD_ONLY = {
    "in_the_first_user_message": IN_THE_FIRST_USER_MESSAGE,
    "before_the_last_user_message": BEFORE_THE_LAST_USER_MESSAGE,
    "after_the_conversation": AFTER_THE_CONVERSATION,
    "head_reads_the_last_message": HEAD_READS_THE_LAST_MESSAGE,
    "head_sets_a_name": HEAD_SETS_A_NAME,
    "macro_reads_the_tools": MACRO_READS_THE_TOOLS,
    "head_calls_a_macro_reading_messages": HEAD_CALLS_A_MACRO_READING_MESSAGES,
    "head_reads_a_namespace": HEAD_READS_A_NAMESPACE,
}


def local(tokenizer_dir: Path, template: str) -> LocalTemplate:
    return LocalTemplate.load(tokenizer_dir, template)


async def bridges(renderer: ChatRenderer) -> list[Any]:
    """Every canonical bridge's ids, or the refusal's words."""
    return [ids if isinstance(ids, str) else ids.tolist() for _, ids in await canonical_bridges(renderer)]


@pytest.mark.parametrize("name", sorted(HEAD_ONLY))
async def test_where_the_tools_shape_only_the_head_bridges_leave_them_out_token_for_token(
    tokenizer_dir: Path, name: str
) -> None:
    template = local(tokenizer_dir, HEAD_ONLY[name])
    assert tools_only_shape_the_head(HEAD_ONLY[name]) and template.bridges_ignore(TOOLS)
    with_tools = await bridges(ChatRenderer(template))
    assert with_tools == await bridges(ChatRenderer(template, leave_tools_out=template.bridges_ignore(TOOLS)))
    assert any(isinstance(ids, list) and ids for ids in with_tools)
    assert await bridge_check(template) == []


@pytest.mark.parametrize("name", sorted(NOT_HEAD_ONLY))
async def test_where_the_tools_reach_past_the_head_they_are_rendered(tokenizer_dir: Path, name: str) -> None:
    template = local(tokenizer_dir, NOT_HEAD_ONLY[name])
    assert not tools_only_shape_the_head(NOT_HEAD_ONLY[name]) and not template.bridges_ignore(TOOLS)
    with_tools = await bridges(ChatRenderer(template))
    assert with_tools == await bridges(ChatRenderer(template, leave_tools_out=template.bridges_ignore(TOOLS)))
    # leaving them out anyway would have changed a bridge: the no is what keeps these tokens right
    assert with_tools != await bridges(ChatRenderer(template, leave_tools_out=True))


def test_a_template_that_does_not_parse_is_not_read_as_head_only() -> None:
    assert not tools_only_shape_the_head("{% if tools %}{{ tools }")


async def test_bridge_check_finds_a_head_only_verdict_the_renders_contradict(tokenizer_dir: Path) -> None:
    """The check ``core.rendering`` runs before it trusts the verdict: a template read wrong is caught."""
    template = local(tokenizer_dir, BEFORE_THE_LAST_USER_MESSAGE)
    template.bridges_ignore = lambda tools: True  # type: ignore[method-assign]  # as if misread
    diffs = await bridge_check(template)
    assert diffs and all(isinstance(diff.position, int) for diff in diffs)
    assert np.any([diff.local_len != diff.engine_len or diff.local_ids != diff.engine_ids for diff in diffs])
