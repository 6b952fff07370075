"""The proxy's own traces: a span tree per turn, the plugin's traceparent continued and passed on to
the engine, a span per engine attempt, the trace id on the trajectory, and the SDK's helpers linked in."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.app import create_app
from rollout_proxy.embedded import serve_app
from rollout_proxy.proxy import keys
from rollout_proxy.sdk.tracing import wrap_inplace_trace
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.settings import Settings
from rollout_proxy.tracing import otlp_endpoint_from_env
from tests.conftest import TEMPLATES, free_port
from tests.harness import ADMIN_KEY, ProxyHarness

USER = [{"role": "user", "content": "Tell me a fact."}]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def template_name() -> str:
    return "qwen3_style"


@asynccontextmanager
async def traced_proxy(
    engine_urls: list[str], fake: FakeEngine, exporter: InMemorySpanExporter | None, **settings: Any
) -> AsyncIterator[ProxyHarness]:
    """A proxy whose spans go to ``exporter`` (None: no exporter at all, the default)."""
    config = Settings(engines=tuple(engine_urls), admin_key=ADMIN_KEY, **settings)
    app = create_app(config, span_exporters=[exporter] if exporter is not None else [])
    runner, url = await serve_app(app)
    harness = ProxyHarness(url=url, app=app, fake=fake, http=ProxyClient(url, None))
    try:
        yield harness
    finally:
        for client in harness.clients:
            await client.close()
        await harness.http.aclose()
        await runner.cleanup()


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def hex_span(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


def children_of(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def traceparents(engine: FakeEngine, path: str) -> list[str | None]:
    return [headers.get("traceparent") for seen, headers in engine.received if seen == path]


async def test_one_turn_is_a_span_tree_under_the_plugins_trace_and_the_engine_gets_its_traceparent(fake_engine):
    exporter = InMemorySpanExporter()
    async with traced_proxy([fake_engine.url], fake_engine, exporter) as proxy:
        session = await proxy.create_session(USER, max_new_tokens=16)
        fake_engine.queue("Water boils at 100C.")
        exporter.clear()
        answer = await session.client.chat.completions.create(
            model="m", messages=USER, extra_headers={"traceparent": TRACEPARENT}
        )
        spans = list(exporter.get_finished_spans())
        trajectory = await proxy.trajectory(answer.id)

    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "POST /v1/chat/completions"
    assert hex_trace(server) == CLIENT_TRACE and server.parent is not None
    assert format(server.parent.span_id, "016x") == CLIENT_SPAN and server.parent.is_remote
    assert server.attributes is not None and server.attributes["http.response.status_code"] == 200
    assert {hex_trace(s) for s in spans} == {CLIENT_TRACE}  # one trace, the plugin's

    names = [s.name for s in children_of(spans, server)]
    assert "render" in names and "engine POST /v1/completions" in names
    assert "store put_node" in names and "store lease_session" in names  # the turn's read, and its write
    (engine_span,) = [s for s in spans if s.name == "engine POST /v1/completions"]
    assert engine_span.kind is SpanKind.CLIENT
    assert engine_span.attributes is not None and engine_span.attributes["rollout_proxy.engine.url"] == fake_engine.url
    # the engine received the engine call's own span as its parent, in the plugin's trace
    assert traceparents(fake_engine, "/v1/completions")[-1] == f"00-{CLIENT_TRACE}-{hex_span(engine_span)}-01"
    assert trajectory["trace_ids"] == [CLIENT_TRACE]


async def test_a_span_per_engine_attempt_when_a_turn_fails_over(tokenizer_dir, fake_engine):
    exporter = InMemorySpanExporter()
    broken = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    async with (
        FakeEngineServer(broken) as broken_url,
        traced_proxy([broken_url, fake_engine.url], fake_engine, exporter, engine_failure_threshold=10) as proxy,
    ):
        session = await proxy.create_session(USER, max_new_tokens=16)
        broken.set_fault("error")
        fake_engine.queue("Water boils at 100C.")
        broken.queue("Water boils at 100C.")
        exporter.clear()
        answer = await session.client.chat.completions.create(model="m", messages=USER)
        spans = list(exporter.get_finished_spans())
        trajectory = await proxy.trajectory(answer.id)

    attempts = [s for s in spans if s.name == "engine POST /v1/completions"]
    urls = [s.attributes["rollout_proxy.engine.url"] for s in attempts if s.attributes is not None]
    assert sorted(urls) == sorted([broken_url, fake_engine.url])  # the failed attempt, then the one that answered
    (failed,) = [
        s for s in attempts if s.attributes is not None and s.attributes["rollout_proxy.engine.url"] == broken_url
    ]
    assert not failed.status.is_ok
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert trajectory["trace_ids"] == [hex_trace(server)]  # no traceparent came: the proxy's own trace
    assert server.parent is None


async def test_without_an_exporter_the_plugins_trace_still_reaches_the_engine_and_the_trajectory(
    fake_engine, monkeypatch
):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    async with traced_proxy([fake_engine.url], fake_engine, None) as proxy:
        assert not proxy.app[keys.TELEMETRY].recording
        session = await proxy.create_session(USER, max_new_tokens=16)
        fake_engine.queue("Hi.", "Hello.")
        traced = await session.client.chat.completions.create(
            model="m", messages=USER, extra_headers={"traceparent": TRACEPARENT}
        )
        first = traceparents(fake_engine, "/v1/completions")[-1]
        untraced = await session.client.chat.completions.create(
            model="m", messages=[*USER, traced.choices[0].message.model_dump(), {"role": "user", "content": "More."}]
        )
        second = traceparents(fake_engine, "/v1/completions")[-1]
        trajectory = await proxy.trajectory(untraced.id)
    assert first == TRACEPARENT  # passed on as it came (no span of ours in between)
    assert second is None  # nothing to pass on, nothing invented
    assert trajectory["trace_ids"] == [CLIENT_TRACE, None]


def test_the_otlp_endpoint_comes_from_the_standard_variables():
    assert otlp_endpoint_from_env({}) is None
    assert otlp_endpoint_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "http://c:4318"
    both = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318"}
    assert otlp_endpoint_from_env(both) == "http://t:4318"
    assert otlp_endpoint_from_env({**both, "OTEL_SDK_DISABLED": "true"}) is None


@pytest.fixture
def plugin_spans() -> Callable[[], list[ReadableSpan]]:
    """The SDK's spans (OpenTelemetry's process-wide provider, as a plugin's process has it)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    processor = SimpleSpanProcessor(memory)
    provider.add_span_processor(processor)
    yield memory.get_finished_spans  # type: ignore[misc]
    memory.shutdown()  # later spans are dropped, not kept


async def test_an_sdk_traced_llm_call_is_the_parent_of_the_proxys_request(fake_engine, plugin_spans):
    exporter = InMemorySpanExporter()
    async with traced_proxy([fake_engine.url], fake_engine, exporter) as proxy:
        session = await proxy.create_session(USER, max_new_tokens=16)
        client = wrap_inplace_trace(session.client)
        fake_engine.queue("Water boils at 100C.")
        answer = await client.chat.completions.create(model="m", messages=USER)
        trajectory = await proxy.trajectory(answer.id)
        server_spans = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    (llm_call,) = [s for s in plugin_spans() if s.attributes and s.attributes.get("gen_ai.response.id") == answer.id]
    (server,) = [s for s in server_spans if s.name == "POST /v1/chat/completions"]
    assert server.parent is not None and server.parent.span_id == llm_call.context.span_id  # type: ignore[union-attr]
    assert trajectory["trace_ids"] == [hex_trace(llm_call)]


async def test_spans_reach_an_otlp_collector_and_a_collector_that_is_down_changes_no_answer(fake_engine, monkeypatch):
    from tests.sdk.test_tracing import Collector

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # seconds an export may take (the shutdown's flush too)
    collector = Collector()
    collector_runner, collector_url = await serve_app(collector.app())
    try:
        async with ProxyHarness.running(
            engine_urls=[fake_engine.url], fake=fake_engine, otlp_endpoint=collector_url
        ) as proxy:
            session = await proxy.create_session(USER, max_new_tokens=16)
            fake_engine.queue("Hi.")
            await session.client.chat.completions.create(
                model="m", messages=USER, extra_headers={"traceparent": TRACEPARENT}
            )
    finally:
        await collector_runner.cleanup()
    exported = collector.spans()  # the batch was flushed when the proxy stopped
    assert {service for service, *_ in exported} == {"rollout-proxy"}
    turn = [trace_id.hex() for _, name, trace_id, _ in exported if name == "POST /v1/chat/completions"]
    assert turn == [CLIENT_TRACE]

    started = time.monotonic()
    down = f"http://127.0.0.1:{free_port()}"
    async with ProxyHarness.running(engine_urls=[fake_engine.url], fake=fake_engine, otlp_endpoint=down) as proxy:
        session = await proxy.create_session(USER, max_new_tokens=16)
        fake_engine.queue("Hi.")
        answer = await session.client.chat.completions.create(model="m", messages=USER)
        assert answer.choices[0].message.content == "Hi."
    assert time.monotonic() - started < 30  # stopping waits for the flush at most about the OTLP timeout
