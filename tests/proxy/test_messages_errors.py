"""The Messages routes' refusals, as the anthropic SDK reads them: Anthropic's error body and status, whether
to retry (``x-should-retry``), and nothing stored.

The session's ``client_sampling`` decides what the generation parameters every Anthropic client sends do:
``refuse`` (the default) takes a value that changes nothing and refuses the others, naming them.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from rollout_proxy.proxy import keys
from tests.harness import ProxyHarness, store_snapshot
from tests.proxy.test_messages import QUESTION, TOOL, client, one_config

USER = [{"role": "user", "content": QUESTION}]


def anthropic_error(error: anthropic.APIStatusError, kind: str, param: str | None = None) -> None:
    body = error.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == kind, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


@one_config
async def test_claude_codes_generation_parameters_are_refused_by_a_refuse_session_and_no_ops_are_not(
    proxy: ProxyHarness,
):
    proxy.fake.queue("It is sunny.")
    session = await proxy.create_session(USER, chat_template_kwargs={"enable_thinking": True})  # max_new_tokens 256
    before = await store_snapshot(proxy.app[keys.STORE])
    refused = {
        "max_tokens": {"max_tokens": 128000},
        "thinking": {"max_tokens": 256, "thinking": {"type": "adaptive"}},
        "output_config": {"max_tokens": 256, "output_config": {"effort": "medium"}},
        "top_k": {"max_tokens": 256, "extra_body": {"top_k": 40}},
    }
    async with client(proxy, session.api_key) as sdk:
        for param, fields in refused.items():
            with pytest.raises(anthropic.BadRequestError) as caught:
                await sdk.messages.create(model="policy", messages=USER, timeout=30, **fields)
            anthropic_error(caught.value, "invalid_request_error", param)
            assert "client_sampling: ignore" in caught.value.body["error"]["message"]
            assert caught.value.response.headers["x-should-retry"] == "false"
        assert await store_snapshot(proxy.app[keys.STORE]) == before
        # the session's own values change nothing: accepted
        answer = await sdk.messages.create(
            model="policy",
            messages=USER,
            max_tokens=256,
            thinking={"type": "enabled", "budget_tokens": 1024},
            output_config={},
            extra_body={"temperature": 1.0, "top_p": 1.0},
        )
    assert answer.content[-1].text == "It is sunny."


@one_config
async def test_credentials_are_checked_in_x_api_key_and_bearer(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    for options in ({"api_key": "not-a-key"}, {"auth_token": "not-a-key"}):
        async with anthropic.AsyncAnthropic(base_url=proxy.url, max_retries=0, **options) as sdk:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                await sdk.messages.create(model="policy", max_tokens=256, messages=USER)
        anthropic_error(caught.value, "authentication_error")
    status, body = await proxy.request("POST", "/v1/messages", json={}, token=None)
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    # the admin key opens no session
    async with client(proxy, "test-admin-key") as sdk:
        with pytest.raises(anthropic.AuthenticationError):
            await sdk.messages.create(model="policy", max_tokens=256, messages=USER)
    assert session.api_key  # the session itself was never touched


@one_config
async def test_bodies_the_policy_cannot_read_are_refused_naming_the_field(proxy: ProxyHarness):
    session = await proxy.create_session(USER)
    before = await store_snapshot(proxy.app[keys.STORE])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": [image]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"messages": [*USER, {"role": "assistant", "content": "Sure, it is"}]}, "messages[1]"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image]}]}
                ]
            },
            "messages[0].content[0].content[0]",
        ),
        ({"messages": USER, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"messages": USER, "tools": [{"name": "x", "input_schema": "not a schema"}]}, "tools[0].input_schema"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "stream": "yes"}, "stream"),
    ]
    async with client(proxy, session.api_key) as sdk:
        for fields, param in cases:
            with pytest.raises(anthropic.BadRequestError) as caught:
                await sdk.messages.create(model="policy", max_tokens=256, **fields)
            anthropic_error(caught.value, "invalid_request_error")
            assert caught.value.body["error"]["param"].startswith(param), (fields, caught.value.body)
    assert await store_snapshot(proxy.app[keys.STORE]) == before


@one_config
async def test_unknown_routes_methods_and_finished_sessions_read_as_anthropic_errors(proxy: ProxyHarness):
    proxy.fake.queue("It is sunny.")
    session = await proxy.create_session(USER)
    for method, path in (("POST", "/v1/messages/batches"), ("GET", "/v1/v1/models"), ("GET", "/v1/messages")):
        status, body = await proxy.request(method, path, token=session.api_key)
        assert status in (404, 405) and body["type"] == "error", (method, path, body)
        assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    async with client(proxy, session.api_key) as sdk:
        await sdk.messages.create(model="policy", max_tokens=256, messages=USER)
        status, _ = await proxy.request("POST", f"/v1/sessions/{session.session_id}/finish", json={"status": "success"})
        assert status == 200
        with pytest.raises(anthropic.APIStatusError) as caught:  # the SDK would retry a bare 409
            await sdk.messages.create(model="policy", max_tokens=256, messages=USER)
    assert caught.value.status_code in (404, 409)
    assert caught.value.response.headers["x-should-retry"] == "false"
    # the OpenAI routes keep OpenAI's shape
    status, body = await proxy.request("POST", "/v1/chat/completions", json={}, token=None)
    assert status == 401 and set(body) == {"error"}


async def test_no_engine_is_an_overloaded_error_the_sdk_retries(tokenizer_dir):
    async with ProxyHarness.running(engine_urls=["http://127.0.0.1:9"]) as proxy:
        status, created = await proxy.request("POST", "/v1/sessions", json={"sample": {}})
        assert status == 201
        async with client(proxy, created["api_key"]) as sdk:
            with pytest.raises(anthropic.APIStatusError) as caught:
                await sdk.messages.create(model="policy", max_tokens=4096, messages=USER)
    assert caught.value.status_code == 503
    anthropic_error(caught.value, "overloaded_error")
    headers = caught.value.response.headers
    assert headers["x-should-retry"] == "true" and int(headers["retry-after"]) >= 1


@one_config
async def test_count_tokens_counts_the_next_prompt_and_refuses_like_create(proxy: ProxyHarness):
    proxy.fake.queue("It is sunny.")
    session = await proxy.create_session(USER)
    async with client(proxy, session.api_key) as sdk:
        count = await sdk.messages.count_tokens(model="policy", messages=USER, tools=[TOOL])
        answer = await sdk.messages.create(model="policy", max_tokens=256, messages=USER, tools=[TOOL])
        assert count.input_tokens == answer.usage.input_tokens
        with pytest.raises(anthropic.BadRequestError) as caught:
            await sdk.messages.count_tokens(model="policy", messages=[{"role": "user", "content": [{"type": "x"}]}])
    anthropic_error(caught.value, "invalid_request_error", "messages[0].content[0]")
