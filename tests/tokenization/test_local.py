"""Local rendering is the engine's, token for token: ``LocalTemplate`` against the fake engine's
``/tokenize`` (the real SmolLM2 tokenizer, both test templates) over many conversation shapes,
and the vLLM preparation steps it copies, one by one.

The fake engine's own preparation (``vllm_style_messages``) is smaller than vLLM's: it keeps
``reasoning_content``, passes ``None`` content and developer roles through, and hands tools to
the template as sent. The shapes generated here avoid those; ``tests/integration`` compares
them with real vLLM.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.fake_engine import FakeEngine
from rollout_proxy.errors import TemplateRenderError
from rollout_proxy.tokenization import local as local_module
from rollout_proxy.tokenization import vllm_chat
from rollout_proxy.tokenization.local import LocalTemplate, LocalTemplateUnavailable, read_chat_template, tokenizer_dir
from tests.conftest import TEMPLATES, TEMPLATES_DIR
from tests.harness import WEATHER_TOOL

QWEN_FILE = str(TEMPLATES_DIR / "qwen3_style.jinja")
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def pairs(tokenizer_dir: Path) -> dict[str, tuple[FakeEngine, LocalTemplate]]:
    """Per test template: the fake engine, and the local renderer given the same template."""
    return {
        "qwen3_style": (
            FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"]),
            LocalTemplate.load(tokenizer_dir, QWEN_FILE),
        ),
        "smollm2_default": (FakeEngine(tokenizer_dir), LocalTemplate.load(tokenizer_dir)),
    }


def engine_ids(fake: FakeEngine, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """What the fake's ``/tokenize`` answers for ``messages``."""
    return fake.encode(fake.render(messages, **kwargs))


# -- conversation shapes ------------------------------------------------------------------------

#: pieces text is made of: plain characters, non-ASCII, whitespace runs, and the strings templates and
#: parsers look for (special tokens written as text are special tokens to the tokenizer on both sides)
PIECES = [*"abcXYZ 019.,:;!?'\"{}[]-_\n\t", "é", "ß", "Tō", "日本", "🌧️", "  ", "\n\n", "<think>", "</think>"]
PIECES += ["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_response>", "<tool_response>"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)
ARGUMENTS = st.dictionaries(
    st.sampled_from(["city", "unit", "days", "q"]),
    st.one_of(TEXT, st.integers(-5, 500), st.booleans(), st.lists(st.integers(0, 9), max_size=3)),
    max_size=3,
)


@st.composite
def assistant(draw: st.DrawFn) -> dict[str, Any]:
    content = draw(TEXT)
    if draw(st.booleans()):
        content = f"<think>\n{draw(TEXT)}\n</think>\n\n{content}"
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = draw(st.lists(st.tuples(st.sampled_from(["get_weather", "lookup"]), ARGUMENTS), max_size=2))
    if calls:
        import orjson

        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": orjson.dumps(args).decode()},
            }
            for i, (name, args) in enumerate(calls)
        ]
    return message


MESSAGE = st.one_of(
    st.builds(lambda text: {"role": "user", "content": text}, TEXT),
    st.builds(lambda text: {"role": "system", "content": text}, TEXT),
    assistant(),
    st.builds(lambda text, n: {"role": "tool", "tool_call_id": f"call_{n}", "content": text}, TEXT, st.integers(0, 1)),
)
CONVERSATION = st.lists(MESSAGE, min_size=1, max_size=7)
KWARGS = st.sampled_from([None, {"enable_thinking": False}, {"enable_thinking": True}, {"unused_flag": 3}])


@pytest.mark.parametrize("name", list(TEMPLATES))
@PROPERTY
@given(messages=CONVERSATION, tools=st.booleans(), add_generation_prompt=st.booleans(), kwargs=KWARGS)
def test_local_render_is_the_engines_for_any_conversation(pairs, name, messages, tools, add_generation_prompt, kwargs):
    fake, template = pairs[name]
    tool_list = [WEATHER_TOOL] if tools else None
    ours = template.render_ids(
        messages, tools=tool_list, add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs
    )
    theirs = engine_ids(fake, messages, tools=tool_list, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    assert ours.tolist() == theirs


@pytest.mark.parametrize("name", list(TEMPLATES))
@PROPERTY
@given(text=st.text(max_size=60) | TEXT)
def test_local_text_encoding_is_the_engines(pairs, name, text):
    fake, template = pairs[name]
    assert template.encode(text).tolist() == fake.encode(text)


async def test_the_async_interface_renders_the_same(pairs):
    fake, template = pairs["qwen3_style"]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ids = await template.tokenize_messages(
        messages, tools=[WEATHER_TOOL], add_generation_prompt=True, chat_template_kwargs=None
    )
    assert ids.dtype == np.int32
    assert ids.tolist() == engine_ids(fake, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert (await template.tokenize_text("Paris")).tolist() == fake.encode("Paris")


async def test_a_long_render_leaves_the_event_loop_free(pairs, monkeypatch):
    """A render bigger than OFF_LOOP_CHARS runs in a thread: other tasks keep running meanwhile."""
    _, template = pairs["qwen3_style"]
    threads: list[str] = []
    render_ids = template.render_ids

    def recording(*args: Any, **kwargs: Any) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return render_ids(*args, **kwargs)

    monkeypatch.setattr(template, "render_ids", recording)
    small = [{"role": "user", "content": "short"}]
    await template.tokenize_messages(small, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
    big = [{"role": "user", "content": "word " * (local_module.OFF_LOOP_CHARS // 4)}]
    await template.tokenize_messages(big, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
    assert threads[0] == threading.main_thread().name  # a bridge-sized render stays on the loop
    assert threads[1] != threading.main_thread().name


async def test_a_template_refusal_is_a_template_render_error(tokenizer_dir):
    refusing = "{{ raise_exception('roles must alternate') }}"
    template = LocalTemplate.load(tokenizer_dir, refusing)
    with pytest.raises(TemplateRenderError) as raised:
        await template.tokenize_messages(
            [{"role": "user", "content": "hi"}], tools=None, add_generation_prompt=True, chat_template_kwargs=None
        )
    assert raised.value.status == 400 and "roles must alternate" in raised.value.message


# -- where the files come from --------------------------------------------------------------------


def test_a_tokenizer_directory_needs_tokenizer_files(tmp_path, tokenizer_dir):
    assert tokenizer_dir_of(tokenizer_dir) == tokenizer_dir
    assert tokenizer_dir_of(tmp_path) is None  # exists, but no tokenizer in it
    assert tokenizer_dir_of(tmp_path / "absent") is None
    assert tokenizer_dir_of("") is None


def tokenizer_dir_of(path: Path | str) -> Path | None:
    return tokenizer_dir(str(path))


def test_a_broken_tokenizer_is_unavailable_not_a_crash(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(LocalTemplateUnavailable):
        LocalTemplate.load(tmp_path)


def test_the_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert read_chat_template(str(path)) == "{{ messages[0].content }}"
    assert read_chat_template("{{ 'literal' }}") == "{{ 'literal' }}"  # as vLLM's --chat-template accepts
    with pytest.raises(LocalTemplateUnavailable, match="not found"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_loading_twice_reuses_the_tokenizer(tokenizer_dir):
    assert LocalTemplate.load(tokenizer_dir, QWEN_FILE) is LocalTemplate.load(tokenizer_dir, QWEN_FILE)
    assert LocalTemplate.load(tokenizer_dir) is not LocalTemplate.load(tokenizer_dir, QWEN_FILE)


# -- vLLM's preparation, step by step -------------------------------------------------------------


def test_test_templates_have_the_content_formats_vllm_detects():
    # qwen3_style hands message.content to a macro that loops over parts: vLLM's "openai" format
    assert vllm_chat.detect_content_format(TEMPLATES["qwen3_style"]) == "openai"
    assert vllm_chat.detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    looping = "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
    assert vllm_chat.detect_content_format(looping) == "openai"
    aliased = (
        "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}"
    )
    assert vllm_chat.detect_content_format(aliased) == "openai"
    assert vllm_chat.detect_content_format("{% for x in %}") == "string"  # unparsable: vLLM's default


def test_the_conversation_is_what_vllm_hands_the_template():
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "dropped by vLLM's /tokenize",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1, 2]"}},
                {"id": "d", "type": "function", "function": {"name": "k", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "ok"},
        {"role": "assistant", "content": "done", "reasoning": "kept", "tool_calls": []},
    ]
    conversation = vllm_chat.vllm_conversation(messages, content_format="string", names_developer=False)
    assert conversation == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "function": {"arguments": {"x": 1}, "name": "f"}, "type": "function"},
                {"id": "b", "function": {"arguments": {}, "name": "g"}, "type": "function"},
                {"id": "c", "function": {"arguments": {}, "name": "h"}, "type": "function"},
                {"id": "d", "function": {"arguments": {}, "name": "k"}, "type": "function"},
            ],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "a"},
        {"role": "assistant", "content": "done", "reasoning": "kept", "reasoning_content": "kept"},
    ]
    assert list(conversation[2]["tool_calls"][0]) == ["id", "function", "type"]  # key order reaches tojson
    assert list(conversation[2]["tool_calls"][0]["function"]) == ["arguments", "name"]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the caller's copy is untouched
    parts = vllm_chat.vllm_conversation(messages[3:5], content_format="openai", names_developer=False)
    assert parts[0]["content"] == "ok"  # a tool's content is joined back into a string
    assert parts[1]["content"] == [{"type": "text", "text": "done"}]


def test_developer_messages_become_one_system_message_unless_the_template_names_them():
    messages = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "q"},
        {"role": "developer", "content": "B"},
    ]
    merged = vllm_chat.vllm_conversation(messages, content_format="string", names_developer=False)
    assert merged == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "q"}]
    kept = vllm_chat.vllm_conversation(messages, content_format="string", names_developer=True)
    assert kept[2] == {"role": "developer", "content": "B", "tools": None}
    assert vllm_chat.names_developer_role("{% if m.role == 'developer' %}") is True


def test_tools_are_dumped_as_vllms_request_model():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "extra": 1}}]
    assert vllm_chat.vllm_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}
    ]
    assert vllm_chat.vllm_tools(None) is None


def test_kwargs_the_template_does_not_read_are_not_forwarded():
    variables = vllm_chat.template_variables(TEMPLATES["qwen3_style"])
    assert "enable_thinking" in variables and "messages" in variables
    accepted = vllm_chat.accepted_kwargs(
        {"enable_thinking": False, "unread": 1, "documents": [], "tokenize": True},
        template_vars=variables,
        call_params=frozenset({"documents", "tokenize"}),
    )
    assert accepted == {"enable_thinking": False, "documents": []}


def test_rendering_runs_concurrently_from_threads(pairs):
    """Renders share one template object across threads (off-loop renders and the self-check)."""
    fake, template = pairs["qwen3_style"]
    conversations = [[{"role": "user", "content": f"question {i} " * (i + 1)}] for i in range(16)]

    async def all_at_once() -> list[np.ndarray]:
        return await asyncio.gather(
            *(
                asyncio.to_thread(
                    template.render_ids,
                    messages,
                    tools=[WEATHER_TOOL],
                    add_generation_prompt=True,
                    chat_template_kwargs=None,
                )
                for messages in conversations
            )
        )

    results = asyncio.run(all_at_once())
    for messages, ids in zip(conversations, results, strict=True):
        assert ids.tolist() == engine_ids(fake, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
