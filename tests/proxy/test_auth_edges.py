"""Auth edges: a token opens only a session that exists, must expire, and nothing tells a plugin
(or an unauthenticated caller) where the engines are."""

from __future__ import annotations

import time

import jwt
import pytest

from rollout_proxy.proxy.auth import AUDIENCE
from rollout_proxy.settings import Settings
from tests.conftest import free_port
from tests.harness import ADMIN_KEY, ProxyHarness

USER = [{"role": "user", "content": "Hello there"}]
SECRET = Settings(admin_key=ADMIN_KEY).token_secret


def token(claims: dict) -> str:
    return jwt.encode(claims, SECRET, algorithm="HS256")


def assert_auth_error(status: int, body: dict) -> None:
    assert status == 401, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "authentication_error"


async def test_models_refuses_a_valid_token_of_a_session_that_does_not_exist(proxy):
    ghost = token({"sub": "sess_00000000000000ff", "aud": AUDIENCE, "exp": int(time.time()) + 60})
    assert_auth_error(*await proxy.request("GET", "/v1/models", token=ghost))
    session = await proxy.create_session(USER)  # a live session's token still lists the models
    status, body = await proxy.request("GET", "/v1/models", token=session.api_key)
    assert status == 200 and body["data"][0]["id"] == proxy.fake.model_name


@pytest.mark.parametrize("route", [("GET", "/v1/models"), ("POST", "/v1/chat/completions")])
async def test_a_token_without_exp_is_refused(proxy, route):
    session = await proxy.create_session(USER)
    forever = token({"sub": session.session_id, "aud": AUDIENCE})
    method, path = route
    assert_auth_error(*await proxy.request(method, path, json={"messages": USER}, token=forever))


async def test_readyz_shows_engine_urls_to_the_admin_only(proxy):
    engine_url = proxy.fake.url
    session = await proxy.create_session(USER)
    for credentials in (None, session.api_key, "not-the-admin-key"):
        status, body = await proxy.request("GET", "/readyz", token=credentials)
        assert status == 200
        assert body == {"ready": True, "store": True, "engines": {"healthy": 1, "total": 1}}
    status, body = await proxy.request("GET", "/readyz", token=ADMIN_KEY)
    assert status == 200 and body["engines"] == {"healthy": 1, "total": 1, "urls": {engine_url: True}}


async def test_engine_errors_do_not_name_the_engine(proxy):
    session = await proxy.create_session(USER)
    address = proxy.fake.url.removeprefix("http://")
    proxy.fake.failures.append((500, "the engine fell over"))
    status, body = await proxy.request("POST", "/v1/chat/completions", json={"messages": USER}, token=session.api_key)
    assert status == 502 and "the engine fell over" in body["error"]["message"]
    assert address not in body["error"]["message"]


async def test_an_unreachable_engine_is_not_named_either(store):
    dead = f"127.0.0.1:{free_port()}"
    async with ProxyHarness.running(engine_urls=[f"http://{dead}"], store=store) as proxy:
        session = await proxy.create_session(USER)
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            status, body = await proxy.request(method, path, json={"messages": USER}, token=session.api_key)
            assert status == 503, body
            assert dead not in body["error"]["message"] and dead.split(":")[1] not in body["error"]["message"]


async def test_a_plugin_reading_its_session_does_not_see_the_engine_url(proxy):
    session = await proxy.create_session([{"role": "user", "content": "hi"}])
    status, mine = await proxy.request("GET", f"/v1/sessions/{session.session_id}", token=session.api_key)
    assert status == 200 and mine["id"] == session.session_id and "engine" not in mine
    status, admin_view = await proxy.request("GET", f"/v1/sessions/{session.session_id}")
    assert status == 200 and admin_view["engine"] == proxy.fake.url


def test_a_remembered_token_still_expires_and_a_forged_one_is_never_remembered():
    """Session tokens are verified once and remembered, but never past their ``exp``."""
    import time

    from rollout_proxy.errors import AuthenticationFailed
    from rollout_proxy.proxy.auth import SessionTokens

    now = [time.time()]
    tokens = SessionTokens(b"k" * 32, clock=lambda: now[0])
    token = tokens.issue("sess_a", expires_at=now[0] + 60)
    assert tokens.verify(token).session_id == "sess_a"  # decoded
    assert tokens.verify(token).session_id == "sess_a"  # remembered
    now[0] += 61
    with pytest.raises(AuthenticationFailed, match="expired"):
        tokens.verify(token)
    other = SessionTokens(b"x" * 32)
    with pytest.raises(AuthenticationFailed, match="invalid"):
        other.verify(token)
    with pytest.raises(AuthenticationFailed, match="invalid"):
        other.verify(token)  # a refusal is not remembered as a pass


def test_remembered_tokens_are_forgotten_once_their_sessions_expire():
    """Each token remembered is held until its ``exp`` and no longer, used or not (the app sweeps each second)."""
    import time

    from rollout_proxy.proxy.auth import SessionTokens

    now = float(int(time.time()))  # a token's exp is whole seconds
    tokens = SessionTokens(b"k" * 32, clock=lambda: now)
    for index in range(50):
        tokens.verify(tokens.issue(f"sess_{index:016x}", expires_at=now + 60 + index))
    assert len(tokens) == 50
    assert tokens.expire(now + 60 + 24.5) == 25 and len(tokens) == 25
    assert tokens.expire(now + 200) == 25 and len(tokens) == 0
