"""The seed's tracing helpers on OpenTelemetry, against a proxy on the fake engine.

Spans are read from an in-memory exporter on the process's tracer provider (only the
SDK's own scope, so spans the server may add later do not disturb these trees); the
``traceparent`` headers are read where the proxy received them (a middleware on it).
What happens with no provider and with an OTLP collector runs in a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from devtools.fake_engine import FakeEngine
from rollout_proxy.app import create_app
from rollout_proxy.embedded import BackgroundLoop, BackgroundServer, serve_app
from rollout_proxy.examples.async_weather_rollout import demo_rollout as async_weather_rollout
from rollout_proxy.examples.group_rollout import demo_group_rollout
from rollout_proxy.examples.weather_reward import weather_reward
from rollout_proxy.examples.weather_rollout import demo_rollout as weather_rollout
from rollout_proxy.sdk import (
    ChatCompletionSample,
    GenerationParameterError,
    Plugin,
    PluginStatus,
    RolloutResult,
    observe,
    rollout,
    trace_monitor,
    wrap_client_inplace,
    wrap_inplace_trace,
)
from rollout_proxy.sdk.proxy import UNOPENED_KEY, UNOPENED_URL
from rollout_proxy.sdk.tracing import MAX_VALUE_CHARS, SCOPE
from rollout_proxy.sdk.transport import ProxyClient
from rollout_proxy.settings import Settings
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY
from tests.sdk.conftest import Stack
from tests.sdk.test_examples import CONTEXT, TOOL_CALL, WEATHER_SAMPLE, weather_trajectory

ROOT = Path(__file__).resolve().parents[2]


# -- fixtures ----------------------------------------------------------------------------------


class Recording(SimpleSpanProcessor):
    """Exports finished spans to memory only while a test that reads them runs."""

    def __init__(self) -> None:
        self.memory = InMemorySpanExporter()
        self.on = False
        super().__init__(self.memory)

    def on_end(self, span: ReadableSpan) -> None:
        if self.on:
            super().on_end(span)


@pytest.fixture(scope="session")
def recording() -> Recording:
    """A switchable in-memory exporter on the process's SDK tracer provider (installed if there is none)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    processor = Recording()
    provider.add_span_processor(processor)
    return processor


@pytest.fixture
def spans(recording: Recording) -> Iterator[Callable[[], list[ReadableSpan]]]:
    """The SDK's finished spans since the test began, oldest first."""
    recording.memory.clear()
    recording.on = True
    yield lambda: sorted(
        (s for s in recording.memory.get_finished_spans() if s.instrumentation_scope.name == SCOPE),
        key=lambda s: s.start_time or 0,
    )
    recording.on = False
    recording.memory.clear()


@dataclass
class Seen:
    """The requests the proxy received: (method, path, headers)."""

    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    def traceparents(self, path: str) -> list[str | None]:
        return [headers.get("traceparent") for _, p, headers in self.requests if p == path]


@pytest.fixture
def traced(tokenizer_dir: Path) -> Iterator[tuple[Stack, Seen]]:
    """The SDK test stack (proxy + fake engine on a background loop), recording what the proxy receives."""
    seen = Seen()

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.requests.append((request.method, request.path, {k.lower(): v for k, v in request.headers.items()}))
        return await handler(request)

    def proxy_app() -> web.Application:
        app = create_app(Settings(engines=(fake_url,), admin_key=ADMIN_KEY))
        app.middlewares.append(record)
        return app

    loop = BackgroundLoop("trace-stack")
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    fake_runner, fake_url = loop.run(serve_app(fake.app()))
    server = BackgroundServer(proxy_app, loop=loop)
    server.start()
    with ProxyClient(server.url, None) as http:
        yield Stack(fake=fake, url=server.url, server=server, http=http), seen
    server.stop()
    loop.run(fake_runner.cleanup())
    loop.close()


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent else None


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


# -- the seed's weather rollout, traced ------------------------------------------------------------


def check_weather_trace(stack: Stack, seen: Seen, proxy: Any, result: RolloutResult, spans: list[ReadableSpan]):
    trajectory = weather_trajectory(stack, proxy, result)
    # under @rollout, the span is named after the function (the seed's ``demo_rollout``)
    assert [s.name for s in spans] == ["rollout demo_rollout", "chat smollm2", "get_current_weather", "chat smollm2"]
    root, first_call, tool, second_call = spans
    # one trace: the rollout is the root, the LLM calls and the tool call its children
    assert root.parent is None
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    assert [parent_of(s) for s in spans[1:]] == [root.context.span_id] * 3
    # the rollout is linked to its session and to the responses it made
    response_ids = [first_call.attributes["gen_ai.response.id"], second_call.attributes["gen_ai.response.id"]]
    assert response_ids[1] == trajectory.response_id and response_ids[0] != response_ids[1]
    assert root.attributes["rollout_proxy.session_id"] == proxy.session_id == trajectory.session_id
    assert list(root.attributes["rollout_proxy.response_ids"]) == response_ids
    assert root.attributes["rollout_proxy.plugin.kind"] == "rollout"
    assert root.attributes["rollout_proxy.training_step"] == 3
    assert root.attributes["rollout_proxy.status"] == "success"
    assert json.loads(root.attributes["output.value"])["extra"] == {"tool_calls": 1}
    assert json.loads(root.attributes["input.value"])["sample"]["messages"][0]["content"] == "北京天气怎么样"
    # each LLM call: its usage, what went in and what came out
    assert first_call.kind is trace.SpanKind.CLIENT and first_call.attributes["gen_ai.request.model"] == "smollm2"
    assert (
        first_call.attributes["gen_ai.usage.output_tokens"] > 0
        and first_call.attributes["gen_ai.usage.input_tokens"] > 0
    )
    assert list(first_call.attributes["gen_ai.response.finish_reasons"]) == ["tool_calls"]
    assert json.loads(second_call.attributes["output.value"])[0]["content"] == "北京今天晴。"
    assert json.loads(second_call.attributes["input.value"])[-1]["role"] == "tool"
    # the tool call, its arguments and result
    assert json.loads(tool.attributes["input.value"]) == {"location": "北京"}
    assert json.loads(json.loads(tool.attributes["output.value"]))["location"] == "北京"
    # the proxy received each call's traceparent: the trace's id and that call's span
    assert seen.traceparents("/v1/chat/completions") == [traceparent_of(first_call), traceparent_of(second_call)]


def test_weather_rollout_sync_span_tree(traced, spans):
    stack, seen = traced
    stack.fake.queue(TOOL_CALL, "北京今天晴。")
    proxy = stack.session(WEATHER_SAMPLE)
    result = weather_rollout(CONTEXT, proxy, WEATHER_SAMPLE)
    assert result.status is PluginStatus.SUCCESS
    check_weather_trace(stack, seen, proxy, result, spans())


async def test_weather_rollout_async_span_tree(traced, spans):
    stack, seen = traced
    stack.fake.queue(TOOL_CALL, "北京今天晴。")
    proxy = stack.session(WEATHER_SAMPLE)
    result = await async_weather_rollout(CONTEXT, proxy, WEATHER_SAMPLE)
    check_weather_trace(stack, seen, proxy, result, spans())


async def test_sync_rollout_in_a_worker_thread_keeps_its_tree(traced, spans):
    """``Plugin.arun`` (the runner's way) runs a sync rollout in a thread: the spans stay one tree."""
    stack, seen = traced
    stack.fake.queue(TOOL_CALL, "北京今天晴。")
    proxy = stack.session(WEATHER_SAMPLE)
    result = await weather_rollout.arun(CONTEXT, proxy, WEATHER_SAMPLE)
    check_weather_trace(stack, seen, proxy, result, spans())


def test_grader_span_names_the_trajectory_and_its_reward(traced, spans):
    stack, _ = traced
    stack.fake.queue(TOOL_CALL, "It is sunny in 北京.")
    proxy = stack.session(WEATHER_SAMPLE)
    trajectory = weather_trajectory(stack, proxy, weather_rollout(CONTEXT, proxy, WEATHER_SAMPLE))
    grade = weather_reward(CONTEXT, WEATHER_SAMPLE, trajectory)
    (grader,) = [s for s in spans() if s.name == "grader weather_reward"]
    assert grader.parent is None and grader.attributes["rollout_proxy.plugin.kind"] == "grader"
    assert list(grader.attributes["rollout_proxy.session_ids"]) == [proxy.session_id]
    assert list(grader.attributes["rollout_proxy.response_ids"]) == [trajectory.response_id]
    assert grader.attributes["rollout_proxy.reward"] == grade.reward
    # the trajectory's messages are the grader's input; its token arrays are not copied into the span
    graded = json.loads(grader.attributes["input.value"])["trajectory"]
    assert graded["messages"][0]["content"] == "北京天气怎么样" and "total_token_ids" not in graded


async def test_group_rollout_span_carries_the_group_response_ids(traced, spans):
    """``@trace_monitor`` over ``@group_rollout`` keeps a Plugin; the result's response ids are on its span."""
    stack, _ = traced
    traced_plugin = trace_monitor(demo_group_rollout)
    assert isinstance(traced_plugin, Plugin) and traced_plugin.spec == demo_group_rollout.spec
    sample = ChatCompletionSample(messages=[{"role": "system", "content": "续写三字经。"}], max_new_tokens=64)
    stack.fake.queue("性本善。", "习相远。", "性乃迁。")
    proxy = stack.session(sample, n_sample=3)
    result = await traced_plugin(CONTEXT, proxy, sample, n_sample=3)
    (root,) = spans()
    assert root.name == "rollout group_rollout"
    assert list(root.attributes["rollout_proxy.response_ids"]) == [r.id for r in result.responses]
    assert root.attributes["rollout_proxy.session_id"] == proxy.session_id


def test_a_failed_rollout_is_still_linked_to_its_session(traced, spans):
    stack, _ = traced
    sample = ChatCompletionSample(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=16)

    @rollout(name="broken")
    @trace_monitor
    def broken(context, proxy, sample):
        raise RuntimeError("tool server down")

    @rollout(name="gave_up")
    @trace_monitor
    def gave_up(context, proxy, sample):
        return RolloutResult(status=PluginStatus.FAILURE, error="no answer")

    proxy = stack.session(sample)
    with pytest.raises(RuntimeError, match="tool server down"):
        broken(CONTEXT, proxy, sample)
    gave_up(CONTEXT, proxy, sample)
    raised, failed = spans()
    assert raised.attributes["rollout_proxy.session_id"] == proxy.session_id
    assert raised.status.status_code is trace.StatusCode.ERROR and [e.name for e in raised.events] == ["exception"]
    assert failed.attributes["rollout_proxy.status"] == "failure"
    assert failed.status.status_code is trace.StatusCode.ERROR and failed.status.description == "no answer"
    proxy.close()


# -- wrap_inplace_trace composes with the SDK's own wrappers -------------------------------------


@pytest.mark.parametrize("trace_first", [True, False], ids=["trace-then-sdk", "sdk-then-trace"])
def test_wrap_inplace_trace_composes_with_the_sdk_wrapper_in_either_order(traced, spans, trace_first):
    stack, seen = traced
    sample = ChatCompletionSample(messages=[{"role": "user", "content": "Say hi."}], max_new_tokens=32)
    proxy = stack.session(sample)
    client = openai.OpenAI(base_url=UNOPENED_URL, api_key=UNOPENED_KEY)
    if trace_first:
        wrap_client_inplace(wrap_inplace_trace(client), proxy)
    else:
        wrap_inplace_trace(wrap_client_inplace(client, proxy))
    wrap_inplace_trace(client)  # a second wrap is a no-op: still one span per call

    stack.fake.queue("Hi!")
    completion = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}])
    (call,) = spans()
    assert call.attributes["gen_ai.response.id"] == completion.id
    assert seen.traceparents("/v1/chat/completions") == [traceparent_of(call)]
    assert proxy.messages[-1]["content"] == "Hi!"  # the SDK wrapper still records the answer

    # the SDK wrapper still refuses pinned parameters, before anything is sent
    with pytest.raises(GenerationParameterError):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], temperature=0.3)
    assert len(seen.traceparents("/v1/chat/completions")) == 1
    client.close()
    proxy.close()


async def test_wrap_inplace_trace_on_the_async_responses_api(traced, spans):
    stack, seen = traced
    sample = ChatCompletionSample(messages=[{"role": "user", "content": "Count."}], max_new_tokens=32)
    proxy = stack.session(sample)
    client = wrap_inplace_trace(proxy.async_rollout_client())
    stack.fake.queue("One.", "Two.")
    first = await client.responses.create(model="smollm2", input=[{"role": "user", "content": "Count."}])
    second = await client.responses.create(
        model="smollm2", input=[{"role": "user", "content": "Next."}], previous_response_id=first.id
    )
    calls = spans()
    assert [s.attributes["gen_ai.response.id"] for s in calls] == [first.id, second.id]
    assert calls[1].attributes["rollout_proxy.previous_response_id"] == first.id
    assert calls[1].attributes["rollout_proxy.api"] == "responses"
    assert seen.traceparents("/v1/responses") == [traceparent_of(s) for s in calls]
    await proxy.aclose()


def test_a_caller_traceparent_is_kept(traced, spans):
    """A plugin that sends its own ``traceparent`` keeps it (explicit beats implicit)."""
    stack, seen = traced
    sample = ChatCompletionSample(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=16)
    proxy = stack.session(sample)
    client = wrap_inplace_trace(proxy.rollout_client())
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    stack.fake.queue("Hello.")
    client.chat.completions.create(model="smollm2", messages=sample.message_dicts(), extra_headers={"traceparent": own})
    assert seen.traceparents("/v1/chat/completions") == [own]
    proxy.close()


# -- @observe() and @trace_monitor on any function ---------------------------------------------


def test_observe_records_inputs_and_outputs_within_the_size_limit(spans):
    @observe()
    def lookup(city: str, unit: str = "C") -> dict[str, Any]:
        return {"city": city, "unit": unit}

    @observe(name="long output")
    def long_text(n: int) -> str:
        return "x" * n

    assert lookup("Oslo") == {"city": "Oslo", "unit": "C"}
    assert long_text(3 * MAX_VALUE_CHARS) == "x" * (3 * MAX_VALUE_CHARS)
    first, second = spans()
    assert first.name.endswith("lookup") and json.loads(first.attributes["input.value"]) == {"city": "Oslo"}
    assert json.loads(first.attributes["output.value"]) == {"city": "Oslo", "unit": "C"}
    assert second.name == "long output"
    cut = second.attributes["output.value"]
    assert len(cut) < MAX_VALUE_CHARS + 40 and cut.endswith(f"…(+{3 * MAX_VALUE_CHARS + 2 - MAX_VALUE_CHARS} chars)")


async def test_observe_async_function_and_exception(spans):
    @observe()
    async def fetch(url: str) -> str:
        await asyncio.sleep(0)
        return url.upper()

    @observe
    async def broken() -> None:
        raise ValueError("tool failed")

    assert await fetch("a") == "A"
    with pytest.raises(ValueError, match="tool failed"):
        await broken()
    ok, failed = spans()
    assert json.loads(ok.attributes["output.value"]) == "A"
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert [event.name for event in failed.events] == ["exception"]


def test_trace_monitor_over_and_under_rollout_keeps_the_plugin(spans):
    """Both decorator orders give a ``Plugin`` the runner can load, with one span per call."""

    def body(context, proxy, sample):
        return RolloutResult(extra={"seen": sample.messages[0].content})

    under = rollout(name="under")(trace_monitor(body))
    over = trace_monitor(rollout(name="over")(body))
    sample = ChatCompletionSample(messages=[{"role": "user", "content": "hi"}])
    for plugin in (under, over):
        assert isinstance(plugin, Plugin) and not plugin.spec.is_async
        assert plugin(CONTEXT, None, sample).extra == {"seen": "hi"}
    assert [s.name for s in spans()] == ["rollout body", "rollout over"]


# -- in a fresh interpreter: no provider, and an OTLP collector -------------------------------------

NO_EXPORTER_SCRIPT = """
import asyncio, sys
import httpx2, openai
from rollout_proxy.sdk import ChatCompletionSample, PluginContext, RolloutResult, observe, rollout, trace_monitor, wrap_inplace_trace

headers = []
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}],
          "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

def answer(request):
    headers.append(dict(request.headers))
    return httpx2.Response(200, json=ANSWER)

client = wrap_inplace_trace(openai.OpenAI(base_url="http://model.invalid/v1", api_key="k",
                                          http_client=httpx2.Client(transport=httpx2.MockTransport(answer))))

@observe()
def add(a, b):
    return a + b

@rollout
@trace_monitor
def solve(context, proxy, sample):
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}])
    return RolloutResult(extra={"answer": reply.choices[0].message.content, "check": add(2, 2)})

@trace_monitor
async def grade(context, sample, trajectory):
    return 1.0

result = solve(PluginContext(), None, ChatCompletionSample(messages=[{"role": "user", "content": "2+2?"}]))
assert result.extra == {"answer": "4", "check": 4}, result
assert asyncio.run(grade(None, None, None)) == 1.0
assert headers and all("traceparent" not in h for h in headers), headers
assert not any(name.startswith("opentelemetry.sdk") for name in sys.modules), "the OTel SDK was loaded"
"""

EXPORT_SCRIPT = """
import sys, time
from rollout_proxy.sdk import observe, trace_monitor

@observe()
def tool(city):
    return {"city": city}

@trace_monitor
def demo_rollout(context, proxy, sample):
    return tool("Oslo")

demo_rollout(None, None, None)  # the first span sets up the exporter (imports)
started = time.monotonic()
for _ in range(2):
    demo_rollout(None, None, None)
print(f"{time.monotonic() - started:.3f}")
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{env.get('PYTHONPATH', '')}", **extra}


def run_script(script: str, env: dict[str, str], timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return done, time.monotonic() - started


def test_without_an_exporter_nothing_is_sent_printed_or_loaded():
    done, _ = run_script(NO_EXPORTER_SCRIPT, clean_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


@dataclass
class Collector:
    """An OTLP/HTTP trace collector on a local port; ``hang`` seconds before each answer."""

    hang: float = 0.0
    requests: list[ExportTraceServiceRequest] = field(default_factory=list)

    def app(self) -> web.Application:
        async def traces(request: web.Request) -> web.Response:
            body = ExportTraceServiceRequest()
            body.ParseFromString(await request.read())
            self.requests.append(body)
            await asyncio.sleep(self.hang)
            return web.Response(body=b"", content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        return app

    def spans(self) -> list[tuple[str, str, bytes, bytes]]:
        """(service name, span name, trace id, parent span id) of every exported span."""
        found = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                service = next(
                    a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"
                )
                for scope_spans in resource_spans.scope_spans:
                    found += [(service, s.name, s.trace_id, s.parent_span_id) for s in scope_spans.spans]
        return found


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    collector = Collector()
    server = BackgroundServer(collector.app)
    url = server.start()
    yield collector, url
    server.stop()


def test_otlp_env_exports_the_spans_to_a_collector(collector):
    collector_state, url = collector
    done, _ = run_script(EXPORT_SCRIPT, clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=url, OTEL_BSP_SCHEDULE_DELAY="50"))
    assert done.returncode == 0, done.stderr
    exported = collector_state.spans()
    assert sorted(name for _, name, _, _ in exported) == ["rollout demo_rollout"] * 3 + ["tool"] * 3
    assert {service for service, *_ in exported} == {"rollout-plugin"}
    roots = {trace_id for _, name, trace_id, parent in exported if name.startswith("rollout") and not parent}
    assert len(roots) == 3 and {trace_id for _, name, trace_id, _ in exported if name == "tool"} == roots


def test_a_hanging_collector_never_holds_the_plugin_up(collector):
    """Spans are exported off the plugin's thread; exit waits at most the OTLP timeout."""
    collector_state, url = collector
    collector_state.hang = 30.0
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=url, OTEL_EXPORTER_OTLP_TIMEOUT="1", OTEL_SERVICE_NAME="weather")
    done, elapsed = run_script(EXPORT_SCRIPT, env)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip()) < 5.0  # two traced rollouts: no export on the caller's thread
    assert elapsed < 25.0  # not the collector's 30 s
    assert collector_state.requests  # it did try to send


def test_a_collector_that_is_down_changes_no_result():
    from tests.conftest import free_port

    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}", OTEL_EXPORTER_OTLP_TIMEOUT="1")
    done, elapsed = run_script(EXPORT_SCRIPT, env)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip()) < 5.0 and elapsed < 25.0
