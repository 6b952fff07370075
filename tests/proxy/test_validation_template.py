"""What the chat template cannot render is the request's fault (400), found at session create.

vLLM answers a template that fails on ``/tokenize`` (a Jinja error, a ``raise_exception``)
with a 400 carrying the error's text. The fake engine here does the same, with a template
that insists on alternating roles as many real ones do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.engines.base import SamplingParams
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import EngineError, TemplateRenderError
from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness, store_snapshot

ALTERNATING = (
    "{%- for message in messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
USER = [{"role": "user", "content": "Hello there"}]
TWO_USERS = [*USER, {"role": "user", "content": "Are you there?"}]


@pytest.fixture
async def engine(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    """The fake engine answers a template failure on ``/tokenize`` with a 400, as vLLM does."""
    fake = FakeEngine(tokenizer_dir, chat_template=ALTERNATING)
    async with FakeEngineServer(fake) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture
async def proxy(engine, store) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(engine_urls=[engine.url], store=store, fake=engine) as harness:
        yield harness


async def test_a_template_failure_on_tokenize_is_a_template_render_error(engine):
    client = VLLMEngine(engine.url)
    try:
        with pytest.raises(TemplateRenderError) as raised:
            await client.tokenize_messages(TWO_USERS, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
        assert raised.value.status == 400 and "must alternate" in raised.value.message
        # a 4xx on a completion is still the engine's answer (502), not the request's template
        engine.failures.append((400, "the engine refused this completion"))
        prompt = await client.tokenize_messages(USER, tools=None, add_generation_prompt=True, chat_template_kwargs=None)
        with pytest.raises(EngineError) as refused:
            await client.complete(prompt, SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, top_k=0))
        assert not isinstance(refused.value, TemplateRenderError) and refused.value.status == 502
    finally:
        await client.close()


async def test_a_sample_the_template_cannot_render_is_400_at_create(proxy):
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await proxy.request("POST", "/v1/sessions", json={"sample": {"messages": TWO_USERS}})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "template_render_failed"
    assert body["error"]["param"] == "sample.messages" and "must alternate" in body["error"]["message"]
    assert await store_snapshot(proxy.app[keys.STORE]) == before
    assert len(proxy.fake.completions) == 0


async def test_new_messages_the_template_cannot_render_are_400_not_502(proxy):
    session = await proxy.create_session(USER)
    first = await session.client.chat.completions.create(model="m", messages=USER)
    assert first.choices[0].message.content
    before = await store_snapshot(proxy.app[keys.STORE])
    status, body = await proxy.request(
        "POST", "/v1/chat/completions", json={"messages": TWO_USERS}, token=session.api_key
    )
    assert status == 400, body
    assert body["error"]["code"] == "template_render_failed" and body["error"]["param"] == "messages"
    assert await store_snapshot(proxy.app[keys.STORE]) == before
