"""Developer messages reach the tokens whatever the engine does with them (``tokenization.developer``).

vLLM 0.32 hands a template that never names the developer role its developer messages as system ones; an
engine that hands them over as sent (older vLLMs) makes a template without a developer branch drop them
without a word. Through ``DeveloperRole`` the proxy finds out once and renders them as the system turn.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.tokenization.developer import DeveloperRole
from rollout_proxy.tokenization.local import LocalTemplate
from rollout_proxy.tokenization.selfcheck import self_check
from tests.conftest import TEMPLATES, TEMPLATES_DIR

PROMPT = [
    {"role": "developer", "content": "You are a coding agent. Always answer in French."},
    {"role": "user", "content": "Read marker.txt."},
]


@pytest.fixture(params=["system", "as_is"])
async def engine(request: pytest.FixtureRequest, tokenizer_dir: Path) -> AsyncIterator[tuple[FakeEngine, VLLMEngine]]:
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], developer_role=request.param)
    async with FakeEngineServer(fake) as url:
        client = VLLMEngine(url)
        yield fake, client
        await client.close()


def text_of(fake: FakeEngine, ids) -> str:
    return fake.decode([int(i) for i in ids])


async def test_a_developer_message_is_rendered_as_the_system_turn(engine):
    fake, client = engine
    raw = await client.tokenize_messages(PROMPT, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
    wrapped = DeveloperRole(client)
    ids = await wrapped.tokenize_messages(PROMPT, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
    assert "Always answer in French." in text_of(fake, ids)
    assert text_of(fake, ids).startswith("<|im_start|>system\nYou are a coding agent.")
    if fake.developer_role == "as_is":  # the defect: the engine's own render drops it, without a word
        assert "Always answer in French." not in text_of(fake, raw)
        assert not await wrapped.renders_developer()
    else:  # vLLM 0.32: the engine renders it already; nothing is changed
        assert list(raw) == list(ids) and await wrapped.renders_developer()


async def test_the_engine_is_asked_once(engine):
    fake, client = engine
    wrapped = DeveloperRole(client)
    for _ in range(3):
        await wrapped.tokenize_messages(PROMPT, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
    tokenize_calls = [path for path, _ in fake.received if path == "/tokenize"]
    assert len(tokenize_calls) == 3 + 2  # three renders and the two renders of the one question


async def test_the_self_check_covers_developer_messages(tokenizer_dir, engine):
    """Local rendering (vLLM 0.32's rule) agrees with either engine through the wrapper, and the raw render
    of an engine that drops developer messages fails the check on exactly the developer cases."""
    fake, client = engine
    local = LocalTemplate.load(tokenizer_dir, str(TEMPLATES_DIR / "qwen3_style.jinja"))
    report = await self_check(local, DeveloperRole(client))
    assert report.passed, [diff.log_fields() for diff in report.diffs]
    raw = await self_check(local, client)
    if fake.developer_role == "as_is":
        assert {diff.case.split("/")[0] for diff in raw.diffs} == {
            "developer_prompt",
            "system_and_developer",
            "anchor_developer",
            "anchor_developer_then_user",
        }
    else:
        assert raw.passed
