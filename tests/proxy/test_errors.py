"""Every error status, with an OpenAI-style body, and no change to the stored state."""

from __future__ import annotations

import time

import jwt
import openai
import pytest

from rollout_proxy.proxy.auth import AUDIENCE, SessionTokens
from rollout_proxy.settings import Settings
from tests.conftest import free_port
from tests.harness import ADMIN_KEY, ProxyHarness, store_snapshot

USER = [{"role": "user", "content": "Hello there"}]


def assert_openai_error(body, *, status_type: str, param: str | None = None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == status_type
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.fixture
async def ready(proxy: ProxyHarness):
    """A proxy with one session that already has a turn, and the state to compare with."""
    session = await proxy.create_session(USER)
    first = await session.client.chat.completions.create(model="m", messages=USER)
    return proxy, session, first


async def unchanged(proxy: ProxyHarness, before) -> bool:
    from rollout_proxy.proxy import keys

    return await store_snapshot(proxy.app[keys.STORE]) == before


async def snapshot(proxy: ProxyHarness):
    from rollout_proxy.proxy import keys

    return await store_snapshot(proxy.app[keys.STORE])


async def test_malformed_json_is_400(ready):
    proxy, session, _ = ready
    before = await snapshot(proxy)
    status, body = await proxy.request(
        "POST",
        "/v1/chat/completions",
        data=b'{"messages": [',
        token=session.api_key,
        headers={"Content-Type": "application/json"},
    )
    assert status == 400
    assert_openai_error(body, status_type="invalid_request_error")
    assert await unchanged(proxy, before)


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0]"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"messages": USER, "stream": True, "stream_options": "usage"}, "stream_options"),
    ],
)
async def test_bad_chat_request_is_400(ready, payload, param):
    proxy, session, _ = ready
    before = await snapshot(proxy)
    status, body = await proxy.request("POST", "/v1/chat/completions", json=payload, token=session.api_key)
    assert status == 400, body
    assert_openai_error(body, status_type="invalid_request_error", param=param)
    assert await unchanged(proxy, before)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"n": 2}, "n"),
        ({"max_tokens": 10}, "max_tokens"),
        ({"max_completion_tokens": 10}, "max_completion_tokens"),
        ({"extra_body": {"max_new_tokens": 10}}, "max_new_tokens"),
        ({"temperature": 0.5}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"extra_body": {"top_k": 5}}, "top_k"),
        ({"extra_body": {"thinking": {"type": "enabled"}}}, "thinking"),
        ({"seed": 3}, "seed"),
    ],
)
async def test_pinned_generation_parameter_is_400_naming_it(ready, kwargs, param):
    proxy, session, _ = ready
    before = await snapshot(proxy)
    with pytest.raises(openai.BadRequestError) as raised:
        await session.client.chat.completions.create(model="m", messages=USER, **kwargs)
    assert raised.value.status_code == 400
    error = raised.value.body
    assert error["param"] == param and f"'{param}'" in error["message"] and "pinned" in error["message"]
    assert await unchanged(proxy, before)


async def test_model_is_accepted_and_ignored(ready):
    proxy, session, _first = ready
    second = await session.client.chat.completions.create(model="any-name-at-all", messages=USER)
    assert second.model == "any-name-at-all"
    assert proxy.fake.completions[-1]["model"] == proxy.fake.model_name


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"sample": []}, "sample"),
        ({"sample": {"messages": "hello"}}, "sample.messages"),
        ({"client_sampling": "allow"}, "client_sampling"),
        ({"sample": {"messages": USER}, "generation": {"temperature": -1}}, "generation.temperature"),
        ({"sample": {"messages": USER}, "generation": {"top_p": 0}}, "generation.top_p"),
        ({"sample": {"messages": USER}, "generation": {"bogus": 1}}, "generation.bogus"),
        ({"sample": {"messages": [{"role": "user", "content": 5}]}}, "sample.messages[0].content"),
    ],
)
async def test_bad_session_body_is_400(ready, payload, param):
    proxy, _, _ = ready
    before = await snapshot(proxy)
    status, body = await proxy.request("POST", "/v1/sessions", json=payload)
    assert status == 400, body
    assert_openai_error(body, status_type="invalid_request_error", param=param)
    assert await unchanged(proxy, before)


async def test_context_length_exceeded_is_400(ready):
    proxy, session, _ = ready
    before = await snapshot(proxy)
    huge = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as raised:
        await session.client.chat.completions.create(model="m", messages=huge)
    assert raised.value.body["code"] == "context_length_exceeded"
    assert await unchanged(proxy, before)


def expired_token(session_id: str) -> str:
    secret = Settings(admin_key=ADMIN_KEY).token_secret
    return SessionTokens(secret).issue(session_id, time.time() - 10)


@pytest.mark.parametrize("case", ["missing", "forged", "expired", "garbage", "admin_key_on_plugin_route"])
async def test_bad_token_is_401(ready, case):
    proxy, session, _ = ready
    before = await snapshot(proxy)
    token = {
        "missing": None,
        "forged": jwt.encode(
            {"sub": session.session_id, "aud": AUDIENCE, "exp": int(time.time()) + 60},
            "a-different-secret-of-thirty-two-bytes!",
            algorithm="HS256",
        ),
        "expired": expired_token(session.session_id),
        "garbage": "not-a-token",
        "admin_key_on_plugin_route": ADMIN_KEY,
    }[case]
    status, body = await proxy.request("POST", "/v1/chat/completions", json={"messages": USER}, token=token)
    assert status == 401, body
    assert_openai_error(body, status_type="authentication_error")
    assert await unchanged(proxy, before)


async def test_session_token_cannot_create_sessions(ready):
    proxy, session, _ = ready
    before = await snapshot(proxy)
    status, body = await proxy.request(
        "POST", "/v1/sessions", json={"sample": {"messages": USER}}, token=session.api_key
    )
    assert status == 401
    assert_openai_error(body, status_type="authentication_error")
    assert await unchanged(proxy, before)


async def test_unknown_and_foreign_ids_are_404(ready):
    proxy, session, _first = ready
    other = await proxy.create_session(USER)
    other_first = await other.client.chat.completions.create(model="m", messages=USER)
    before = await snapshot(proxy)
    cases = [
        ("GET", "/v1/sessions/sess_0000000000000000/trajectory", ADMIN_KEY),
        ("GET", f"/v1/responses/resp_{'0' * 32}/trajectory", ADMIN_KEY),
        ("GET", "/v1/responses/not-an-id/trajectory", ADMIN_KEY),
        # another session's data does not exist for a plugin
        ("GET", f"/v1/responses/{other_first.id}/trajectory", session.api_key),
        ("GET", f"/v1/sessions/{other.session_id}/trajectory", session.api_key),
        ("GET", f"/v1/sessions/{other.session_id}", session.api_key),
        ("GET", "/v1/no/such/route", ADMIN_KEY),
    ]
    for method, path, token in cases:
        status, body = await proxy.request(method, path, token=token)
        assert status == 404, (path, body)
        assert_openai_error(body, status_type="not_found_error")
    # a valid token of a session that does not exist (expired and swept)
    ghost = SessionTokens(Settings(admin_key=ADMIN_KEY).token_secret).issue("sess_00000000000000ff", time.time() + 60)
    status, body = await proxy.request("POST", "/v1/chat/completions", json={"messages": USER}, token=ghost)
    assert status == 404
    assert await unchanged(proxy, before)


async def test_body_too_large_is_413(fake_engine, store):
    async with ProxyHarness.running(
        engine_urls=[fake_engine.url], store=store, fake=fake_engine, max_body_bytes=4096
    ) as proxy:
        session = await proxy.create_session(USER)
        before = await snapshot(proxy)
        status, body = await proxy.request(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x" * 10000}]},
            token=session.api_key,
        )
        assert status == 413
        assert_openai_error(body, status_type="invalid_request_error")
        assert await unchanged(proxy, before)


async def test_engine_failure_is_502(ready):
    proxy, session, _ = ready
    before = await snapshot(proxy)
    proxy.fake.failures.append((500, "the engine fell over"))
    with pytest.raises(openai.APIStatusError) as raised:
        await session.client.chat.completions.create(model="m", messages=USER)
    assert raised.value.status_code == 502
    assert "the engine fell over" in raised.value.body["message"]
    assert await unchanged(proxy, before)


async def test_unreachable_engine_is_503(store):
    dead = f"http://127.0.0.1:{free_port()}"
    async with ProxyHarness.running(engine_urls=[dead], store=store) as proxy:
        session = await proxy.create_session(USER)
        before = await snapshot(proxy)
        with pytest.raises(openai.APIStatusError) as raised:
            await session.client.chat.completions.create(model="m", messages=USER)
        assert raised.value.status_code == 503
        assert raised.value.body["type"] == "service_unavailable"
        assert await unchanged(proxy, before)
        status, body = await proxy.request("GET", "/readyz", token=None)
        assert status == 503 and body["engines"] == {"healthy": 0, "total": 1}
