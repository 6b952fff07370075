"""The self-check: canonical conversations rendered locally and by the engine's ``/tokenize``.

It passes when local rendering is the engine's (both test templates), and names the first
differing token, with ids and token strings on both sides, when it is not.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.tokenization.local import LocalTemplate
from rollout_proxy.tokenization.selfcheck import Case, canonical_cases, self_check, token_diff
from tests.conftest import TEMPLATES, TEMPLATES_DIR

QWEN_FILE = str(TEMPLATES_DIR / "qwen3_style.jinja")
ALTERNATING = (
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


@pytest.fixture
async def engine(fake_engine: FakeEngine) -> AsyncIterator[VLLMEngine]:
    client = VLLMEngine(fake_engine.url)
    yield client
    await client.close()


def local_for(tokenizer_dir: Path, template_name: str) -> LocalTemplate:
    return LocalTemplate.load(tokenizer_dir, QWEN_FILE if TEMPLATES[template_name] else None)


def test_the_canonical_set_covers_what_turns_render():
    cases = canonical_cases()
    messages = [message for case in cases for message in case.messages]
    assert {message["role"] for message in messages} == {"system", "developer", "user", "assistant", "tool"}
    assert any(message.get("tool_calls") for message in messages)
    assert any("<think>" in (message.get("content") or "") for message in messages)
    assert any(case.tools for case in cases) and any(case.chat_template_kwargs for case in cases)
    assert max(sum(message["role"] == "user" for message in case.messages) for case in cases) >= 3
    assert any(
        case.messages[i]["role"] == case.messages[i + 1]["role"] == "tool"
        for case in cases
        for i in range(len(case.messages) - 1)
    )
    roles = ("user", "assistant", "tool", "system", "developer")
    assert {f"anchor_{role}_then_user" for role in roles} <= {c.name for c in cases}


async def test_the_self_check_passes_when_local_is_the_engines_template(tokenizer_dir, template_name, engine):
    report = await self_check(local_for(tokenizer_dir, template_name), engine)
    assert report.passed, [diff.log_fields() for diff in report.diffs]
    assert report.rendered == 2 * len(canonical_cases())  # every case, with and without the generation prompt


@pytest.mark.parametrize("template_name", ["smollm2_default"])
async def test_another_template_is_caught_with_the_first_differing_tokens(tokenizer_dir, template_name, engine):
    report = await self_check(LocalTemplate.load(tokenizer_dir, QWEN_FILE), engine)  # engine: SmolLM2's own
    assert not report.passed and report.diffs
    first = next(diff for diff in report.diffs if diff.case == "user_only/generation_prompt")
    # SmolLM2 injects its default system prompt; the Qwen3-style template does not
    assert first.position == 1
    assert first.local_tokens[first.position - first.window_start] == "user"
    assert first.engine_tokens[first.position - first.window_start] == "system"
    assert first.local_ids[0] == first.engine_ids[0]  # the window starts before the difference
    assert len(first.local_ids) == len(first.local_tokens)


async def test_a_case_refused_on_both_sides_agrees_one_side_only_does_not(tokenizer_dir):
    fake = FakeEngine(tokenizer_dir, chat_template=ALTERNATING)
    with capture_logs() as logs:  # the client logs each refusal it relays
        async with FakeEngineServer(fake) as url:
            engine = VLLMEngine(url)
            try:
                report = await self_check(LocalTemplate.load(tokenizer_dir, ALTERNATING), engine)
                assert report.passed and report.refused > 0 and report.rendered > 0  # system and tool turns refused
                lenient = await self_check(LocalTemplate.load(tokenizer_dir), engine)
            finally:
                await engine.close()
    assert not lenient.passed
    assert any("only the engine side refused" in diff.note for diff in lenient.diffs)
    assert any(entry["event"] == "engine_call_failed" for entry in logs)


async def test_a_template_that_renders_nothing_does_not_pass(tokenizer_dir):
    refusing = [Case("refused", [{"role": "system", "content": "x"}, {"role": "system", "content": "y"}])]
    fake = FakeEngine(tokenizer_dir, chat_template=ALTERNATING)
    with capture_logs():
        async with FakeEngineServer(fake) as url:
            client = VLLMEngine(url)
            try:
                report = await self_check(LocalTemplate.load(tokenizer_dir, ALTERNATING), client, cases=refusing)
            finally:
                await client.close()
    assert report.refused == 2 and report.rendered == 0 and not report.passed


def test_a_token_diff_shows_a_window_around_the_first_difference(tokenizer_dir):
    template = LocalTemplate.load(tokenizer_dir)
    ours = np.asarray(list(range(100, 130)), dtype=np.int32)
    theirs = ours.copy()
    theirs[20] = 7
    diff = token_diff("case", ours, theirs, template)
    assert diff is not None and diff.position == 20 and diff.window_start == 12
    assert diff.local_ids == list(range(112, 128)) and diff.engine_ids[8] == 7
    assert diff.local_tokens == template.token_strs(diff.local_ids)
    shorter = token_diff("prefix", ours[:25], ours, template)
    assert shorter is not None and shorter.position == 25 and shorter.local_len == 25 and shorter.engine_len == 30
    assert token_diff("same", ours, ours.copy(), template) is None
