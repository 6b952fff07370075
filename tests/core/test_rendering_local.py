"""Local rendering through the proxy: one engine call per turn once the self-check passes, and the
engine's ``/tokenize`` whenever local rendering is not proven to be the engine's.

The fake engine is served with a middleware that counts the calls it receives and can make
its ``/tokenize`` fail or hang; the proxy runs with ``rendering="auto"``, as it does by default.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from devtools.fake_engine import FakeEngine
from rollout_proxy.app import create_app
from rollout_proxy.core.rendering import RenderSource
from rollout_proxy.embedded import serve_app
from rollout_proxy.proxy import keys
from rollout_proxy.settings import Settings
from rollout_proxy.tokenization.local import LocalTemplate
from tests.conftest import TEMPLATES, TEMPLATES_DIR, free_port
from tests.harness import ADMIN_KEY, WEATHER_TOOL, ProxyHarness, store_snapshot
from tests.tokenization.test_tools_head import BEFORE_THE_LAST_USER_MESSAGE

QWEN_FILE = str(TEMPLATES_DIR / "qwen3_style.jinja")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = {"role": "user", "content": "What's the weather in Paris?"}


@dataclass
class Watched:
    """A fake engine on a real port, its calls counted; ``tokenize_fault``: None, "error" or "hang"."""

    fake: FakeEngine
    url: str = ""
    calls: Counter[str] = field(default_factory=Counter)
    tokenize_fault: str | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        self.calls[request.path] += 1
        if request.path == "/tokenize" and self.tokenize_fault == "error":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        if request.path == "/tokenize" and self.tokenize_fault == "hang":
            await self.released.wait()
        return await handler(request)

    @property
    def tokenizes(self) -> int:
        return self.calls["/tokenize"]

    @property
    def completions(self) -> int:
        return self.calls["/v1/completions"]


@asynccontextmanager
async def watched(fake: FakeEngine, port: int = 0) -> AsyncIterator[Watched]:
    engine = Watched(fake)
    app = fake.app()
    app.middlewares.append(engine.middleware)
    runner, engine.url = await serve_app(app, port=port)
    try:
        yield engine
    finally:
        engine.released.set()
        await runner.cleanup()


@pytest.fixture
async def engine(tokenizer_dir: Path, template_name: str) -> AsyncIterator[Watched]:
    async with watched(FakeEngine(tokenizer_dir, chat_template=TEMPLATES[template_name])) as served:
        yield served


def local_template_for(template_name: str) -> str:
    """What the proxy is told the engines were started with (``--chat-template``)."""
    return QWEN_FILE if TEMPLATES[template_name] else ""


@asynccontextmanager
async def proxy_for(engine: Watched, **settings: Any) -> AsyncIterator[ProxyHarness]:
    async with ProxyHarness.running(engine_urls=[engine.url], fake=engine.fake, **settings) as harness:
        yield harness


def counter(proxy: ProxyHarness, name: str, **labels: str) -> float:
    return proxy.app[keys.METRICS].value(name, **labels)


async def tool_chat(proxy: ProxyHarness, fake: FakeEngine, *, tools: bool) -> list[list[int]]:
    """Four turns (a tool call, its result, a follow-up, another); returns the prompts the engine got."""
    first_prompt = len(fake.prompts)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, USER]
    session = await proxy.create_session(messages, tools=[WEATHER_TOOL] if tools else None)
    fake.queue(CALL, "It is sunny, 21C.", "Rain, 12C.", "You are welcome.")
    follow_ups: list[dict[str, Any] | None] = [None, {"role": "user", "content": "And Berlin?"}, None, None]
    for turn in range(4):
        answer = await session.client.chat.completions.create(model="m", messages=messages)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21C"})
        elif follow_ups[turn] is not None:
            messages.append(follow_ups[turn])
        else:
            messages.append({"role": "user", "content": f"Thanks ({turn})."})
    return fake.prompts[first_prompt:]


async def test_a_turn_is_one_engine_call_once_the_self_check_passed(engine, template_name):
    async with proxy_for(engine, chat_template=local_template_for(template_name), render_check_rate=0.0) as proxy:
        await proxy.create_session([USER])  # the engine's self-check runs before this session's probe render
        assert counter(proxy, "render_checks_total", check="startup", outcome="match") == 1
        # Qwen's template reads the tools in its system turn alone: bridges leave them out (SmolLM2's reads none)
        assert proxy.app[keys.RENDERERS].bridges_leave_tools_out(engine.url)
        before = engine.tokenizes
        prompts = await tool_chat(proxy, engine.fake, tools=template_name == "qwen3_style")
        assert engine.tokenizes == before  # no /tokenize after start
        assert engine.completions == len(prompts) == 4  # one /v1/completions per turn
        assert counter(proxy, "renders_total", source="local") == 4
    # the same chat rendered by the engine's /tokenize gives the same prompts, token for token
    async with proxy_for(engine, rendering="engine") as by_engine:
        assert await tool_chat(by_engine, engine.fake, tools=template_name == "qwen3_style") == prompts
        assert counter(by_engine, "renders_total", source="local") == 0


@pytest.mark.parametrize("template_name", ["smollm2_default"])
async def test_another_template_is_caught_at_start_and_the_engine_renders(engine, template_name):
    with capture_logs() as logs:
        async with proxy_for(engine, chat_template=QWEN_FILE, render_check_rate=0.0) as proxy:
            before = engine.tokenizes
            prompts = await tool_chat(proxy, engine.fake, tools=False)
            assert engine.tokenizes > before  # every turn renders through the engine
            assert counter(proxy, "render_fallbacks_total", reason="startup_check") == 1
            assert counter(proxy, "renders_total", source="engine") == 4
    mismatches = [entry for entry in logs if entry["event"] == "render_mismatch" and entry["check"] == "startup"]
    assert mismatches, [entry["event"] for entry in logs]
    diff = mismatches[0]
    assert diff["case"] == "user_only/generation_prompt"  # the first case where the templates part
    at = diff["first_difference"] - diff["window_start"]
    assert (diff["local_tokens"][at], diff["engine_tokens"][at]) == ("user", "system")  # SmolLM2's default system
    assert diff["local_ids"][:at] == diff["engine_ids"][:at]
    (off,) = [entry for entry in logs if entry["event"] == "local_rendering_off"]
    assert off["mismatches"] >= len(mismatches) and "differs" in off["reason"]
    fake = engine.fake
    expected = fake.encode(fake.render([{"role": "system", "content": "Be brief."}, USER], add_generation_prompt=True))
    assert prompts[0] == expected  # the engine's template, not the one the proxy was wrongly given


async def test_a_template_read_wrong_keeps_the_tools_in_its_bridges(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tools before the last user message (Mistral's shape), as if read as head-only: the canonical bridges,
    rendered both ways when rendering goes local, disagree, so the tools stay in every bridge, said in the
    log, and a tool chat's prompts are the engine's own. (The template is given as its text, as vLLM allows.)"""
    monkeypatch.setattr(LocalTemplate, "bridges_ignore", lambda self, tools: True)
    fake = FakeEngine(tokenizer_dir, chat_template=BEFORE_THE_LAST_USER_MESSAGE)
    with capture_logs() as logs:
        async with (
            watched(fake) as served,
            proxy_for(served, chat_template=BEFORE_THE_LAST_USER_MESSAGE, render_check_rate=0.0) as proxy,
        ):
            prompts = await tool_chat(proxy, fake, tools=True)
            renderers = proxy.app[keys.RENDERERS]
            assert renderers.source(served.url) is RenderSource.LOCAL
            assert not renderers.bridges_leave_tools_out(served.url)
    assert any(entry["event"] == "bridge_tools_mismatch" for entry in logs)
    (on,) = [entry for entry in logs if entry["event"] == "local_rendering_on"]
    assert on["bridges_without_tools"] is False
    # the third turn's bridge ends with a user message: the tools are rendered before it, as the engine does
    assert fake.decode(prompts[2]).count("[TOOLS]") == 2
    async with watched(fake) as served, proxy_for(served, rendering="engine") as by_engine:
        assert await tool_chat(by_engine, fake, tools=True) == prompts


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_a_live_check_that_differs_switches_the_engine_back_to_tokenize(engine, template_name):
    async with proxy_for(engine, chat_template=QWEN_FILE, render_check_rate=1.0) as proxy:
        session = await proxy.create_session([USER], tools=[WEATHER_TOOL])
        engine.fake.queue(CALL, "It is sunny.", "Bye.")
        first = await session.client.chat.completions.create(model="m", messages=[USER])
        assert counter(proxy, "render_checks_total", check="live", outcome="match") == 1
        # the engine restarts with another template: what it renders for a tool result changes
        engine.fake.chat_template = TEMPLATES["qwen3_style"].replace("<tool_response>", "<tool_output>")
        call = first.choices[0].message.tool_calls[0]
        history = [
            USER,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        with capture_logs() as logs:
            second = await session.client.chat.completions.create(model="m", messages=history)
        assert counter(proxy, "render_checks_total", check="live", outcome="mismatch") == 1
        assert counter(proxy, "render_fallbacks_total", reason="live_check") == 1
        assert "<tool_output>" in engine.fake.decode(engine.fake.prompts[-1])  # the turn used the engine's tokens
        assert any(entry["event"] == "render_mismatch" and entry["check"] == "live" for entry in logs)
        before = engine.tokenizes
        history += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
        await session.client.chat.completions.create(model="m", messages=history)
        assert engine.tokenizes > before and counter(proxy, "renders_total", source="engine") == 1
        assert counter(proxy, "render_checks_total", check="live", outcome="match") == 1  # no more checks


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_live_checks_that_agree_keep_rendering_local(engine, template_name):
    async with proxy_for(engine, chat_template=QWEN_FILE, render_check_rate=1.0) as proxy:
        await tool_chat(proxy, engine.fake, tools=True)
        assert counter(proxy, "render_checks_total", check="live", outcome="match") == 4
        assert counter(proxy, "renders_total", source="local") == 4


@pytest.mark.parametrize("template_name", ["smollm2_default"])
async def test_a_live_check_of_an_assistant_turn_without_content_agrees(engine, template_name):
    """An echoed answer with no content at all (None, missing, empty tool calls) is "" to vLLM's /tokenize as to
    the local render: the live check agrees, the turn is answered, rendering stays local (CI caught the fake engine
    refusing it on the 1% of turns checked)."""
    async with proxy_for(engine, render_check_rate=1.0) as proxy:
        session = await proxy.create_session([USER])
        for empty in [
            {"role": "assistant", "content": None},
            {"role": "assistant"},
            {"role": "assistant", "tool_calls": []},
        ]:
            engine.fake.queue("Fine.")
            history = [USER, empty, {"role": "user", "content": "Well?"}]
            await session.client.chat.completions.create(model="m", messages=history)
        assert counter(proxy, "render_checks_total", check="live", outcome="match") == 3
        assert counter(proxy, "render_checks_total", check="live", outcome="mismatch") == 0
        assert counter(proxy, "renders_total", source="local") == 3


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_a_local_refusal_is_asked_of_the_engine_before_it_is_answered(engine, template_name, tmp_path):
    """Local refuses what the engine renders (the canonical set cannot see it): the engine's tokens win."""
    stricter = tmp_path / "stricter.jinja"
    refusal = "{%- for m in messages %}{% if 'FORBIDDEN' in (m.content | string) %}{{ raise_exception('no') }}{% endif %}{% endfor -%}"
    stricter.write_text(refusal + TEMPLATES["qwen3_style"])
    async with proxy_for(engine, chat_template=str(stricter), render_check_rate=0.0) as proxy:
        messages = [{"role": "user", "content": "a FORBIDDEN word"}]
        session = await proxy.create_session(messages)
        await session.client.chat.completions.create(model="m", messages=messages)
        assert counter(proxy, "render_checks_total", check="failure", outcome="mismatch") == 1
        assert counter(proxy, "render_fallbacks_total", reason="local_failure") == 1
        fake = engine.fake
        assert fake.prompts[-1] == fake.encode(fake.render(messages, add_generation_prompt=True))


# -- outside parts failing --------------------------------------------------------------------------


@pytest.mark.parametrize("template_name", ["smollm2_default"])
async def test_an_engine_whose_model_is_not_here_renders_through_the_engine(engine, template_name, tokenizer_dir):
    engine.fake.tokenizer_dir = Path("/models/on/another/host")  # what its /v1/models root now says
    with capture_logs() as logs:
        async with proxy_for(engine) as proxy:
            before = engine.tokenizes
            await tool_chat(proxy, engine.fake, tools=False)
            assert engine.tokenizes > before
            assert counter(proxy, "render_fallbacks_total", reason="no_local_tokenizer") == 1
    off = [entry for entry in logs if entry["event"] == "local_rendering_off"]
    assert off and "--tokenizer" in off[0]["reason"] and "/models/on/another/host" in off[0]["reason"]
    async with proxy_for(engine, tokenizer=str(tokenizer_dir), render_check_rate=0.0) as proxy:
        await proxy.create_session([USER])
        before = engine.tokenizes
        await tool_chat(proxy, engine.fake, tools=False)
        assert engine.tokenizes == before  # --tokenizer names the files the engine's root does not


@pytest.mark.parametrize("template_name", ["smollm2_default"])
async def test_a_broken_tokenizer_directory_renders_through_the_engine(engine, template_name, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"truncated": ')
    with capture_logs() as logs:
        async with proxy_for(engine, tokenizer=str(tmp_path)) as proxy:
            await tool_chat(proxy, engine.fake, tools=False)
            assert counter(proxy, "render_fallbacks_total", reason="no_local_tokenizer") == 1
    assert any(entry["event"] == "local_rendering_off" and str(tmp_path) in entry["reason"] for entry in logs)


async def test_an_engine_down_at_start_is_checked_at_its_first_use(tokenizer_dir):
    port = free_port()
    async with ProxyHarness.running(engine_urls=[f"http://127.0.0.1:{port}"], render_check_rate=0.0) as proxy:
        async with asyncio.timeout(30):  # the start-up check meets no engine (the count, not a clock, says so)
            while not counter(proxy, "render_checks_total", check="startup", outcome="error"):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        async with watched(FakeEngine(tokenizer_dir), port=port) as engine:
            await until_ready(proxy)
            prompts = await tool_chat(proxy, engine.fake, tools=False)
            assert len(prompts) == 4 and engine.completions == 4
            assert counter(proxy, "render_checks_total", check="startup", outcome="match") == 1
            assert counter(proxy, "renders_total", source="local") == 4


async def until_ready(proxy: ProxyHarness) -> None:
    """Wait (at most 20 s) until the proxy says an engine can take turns (its health checks saw it come up)."""
    async with asyncio.timeout(20):
        while (await proxy.request("GET", "/readyz"))[0] != 200:  # noqa: ASYNC110 (polling an HTTP answer)
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_a_failing_tokenize_leaves_a_live_check_undone_not_the_turn(engine, template_name):
    async with proxy_for(engine, chat_template=QWEN_FILE, render_check_rate=1.0) as proxy:
        session = await proxy.create_session([USER])
        engine.tokenize_fault = "error"
        answer = await session.client.chat.completions.create(model="m", messages=[USER])
        assert answer.choices[0].message.content
        assert counter(proxy, "render_checks_total", check="live", outcome="error") == 1
        fake = engine.fake
        assert fake.prompts[-1] == fake.encode(fake.render([USER], add_generation_prompt=True))


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_a_hung_tokenize_during_the_self_check_fails_that_turn_only(engine, template_name):
    engine.tokenize_fault = "hang"
    async with proxy_for(engine, chat_template=QWEN_FILE, engine_timeout=1.0, engine_first_byte_timeout=1.0) as proxy:
        store = proxy.app[keys.STORE]
        status, body = await proxy.request(
            "POST", "/v1/sessions", json={"sample": {"messages": [USER]}, "generation": {"max_new_tokens": 8}}
        )
        assert status == 201, body  # a session is made even when its probe render cannot be done
        token = body["api_key"]
        before = await store_snapshot(store)
        status, refused = await proxy.request(
            "POST", "/v1/chat/completions", json={"model": "m", "messages": [USER]}, token=token
        )
        # the one engine timed out: that is what the client hears (not "no engine can take this turn")
        assert status == 504 and refused["error"]["type"] != "server_error", refused
        assert await store_snapshot(store) == before and engine.completions == 0
        engine.tokenize_fault = None
        engine.released.set()
        status, answered = await proxy.request(
            "POST", "/v1/chat/completions", json={"model": "m", "messages": [USER]}, token=token
        )
        assert status == 200, answered
        assert counter(proxy, "render_checks_total", check="startup", outcome="match") == 1


def test_rendering_settings_are_checked_and_read_from_the_environment(settings_environ):
    with pytest.raises(ValueError, match="rendering"):
        create_app(Settings(admin_key=ADMIN_KEY, rendering="remote"))
    with pytest.raises(ValueError, match="render_check_rate"):
        create_app(Settings(admin_key=ADMIN_KEY, render_check_rate=2.0))
    settings_environ.setenv("ROLLOUT_PROXY_RENDERING", "engine")
    settings_environ.setenv("ROLLOUT_PROXY_TOKENIZER", "/models/m")
    settings_environ.setenv("ROLLOUT_PROXY_CHAT_TEMPLATE", "/models/m/t.jinja")
    settings_environ.setenv("ROLLOUT_PROXY_RENDER_CHECK_RATE", "0.25")
    settings = Settings.from_env()
    assert (settings.rendering, settings.tokenizer, settings.chat_template) == (
        "engine",
        "/models/m",
        "/models/m/t.jinja",
    )
    assert settings.render_check_rate == 0.25


@pytest.mark.parametrize("template_name", ["qwen3_style"])
async def test_a_late_turn_renders_no_more_than_an_early_one(engine, template_name, monkeypatch):
    """No re-render of the history: a bridge renders the anchor and the new messages, whatever came before."""
    rendered: list[tuple[int, int]] = []  # (messages, characters) of every local render
    render_ids = LocalTemplate.render_ids

    def recording(self: LocalTemplate, messages: Any, **kwargs: Any) -> Any:
        rendered.append((len(messages), len(str(messages))))
        return render_ids(self, messages, **kwargs)

    async with proxy_for(engine, chat_template=QWEN_FILE, render_check_rate=0.0) as proxy:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, USER]
        session = await proxy.create_session(messages)
        engine.fake.queue(*(f"Answer number {turn}." for turn in range(40)))
        monkeypatch.setattr(LocalTemplate, "render_ids", recording)
        per_turn: list[list[tuple[int, int]]] = []
        for _ in range(40):
            rendered.clear()
            answer = await session.client.chat.completions.create(model="m", messages=messages)
            per_turn.append(list(rendered))
            messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        assert engine.completions >= 40 and counter(proxy, "renders_total", source="local") == 40
    # turn 2 also learns the anchor's shape once; from then on every turn renders the same few messages,
    # the anchor (user, assistant) and the new user message, with ~80 messages of history behind turn 40
    assert per_turn[2] == per_turn[39] == [(3, per_turn[2][0][1])]
    assert all(count <= 3 for turn in per_turn[1:] for count, _ in turn)
