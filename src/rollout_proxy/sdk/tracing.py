"""The seed's tracing helpers, on OpenTelemetry: ``@trace_monitor``, ``wrap_inplace_trace``, ``@observe()``.

    @rollout(name="demo_rollout", runtime=...)
    @trace_monitor                      # a span per call: session id, response ids, input, output
    async def demo_rollout(context, proxy, sample):
        client = wrap_inplace_trace(proxy.async_rollout_client())  # a span per LLM call
        ...

    @observe()                           # a span per call of any function, inputs and outputs attached
    def get_current_weather(location, unit="摄氏度"): ...

Each LLM call's span sends its W3C ``traceparent`` with the request (``extra_headers``),
so the proxy can continue the trace. Spans go to OpenTelemetry's global tracer provider:
a process that sets none gets one on first use when the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables name a
collector (OTLP over HTTP: the ``otlp`` extra). Without either, every span is OpenTelemetry's
non-recording no-op: nothing is serialized, sent or printed, and no header is added.

Attributes: ``rollout_proxy.*`` for what links a span to the proxy's records (session id,
response ids, plugin, training step, rewards), OpenTelemetry's ``gen_ai.*`` conventions on
LLM calls, and OpenInference's ``input.value`` / ``output.value`` (JSON, at most
``MAX_VALUE_CHARS`` characters each) for what went in and came out.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

import openai
from opentelemetry import propagate, trace
from pydantic import BaseModel

from rollout_proxy.sdk.decorators import Plugin
from rollout_proxy.sdk.proxy import Mode, RolloutInferenceProxy
from rollout_proxy.sdk.types import (
    GroupGraderResult,
    GroupRolloutResult,
    PluginContext,
    PluginStatus,
    SingleGraderResult,
    Trajectory,
)

__all__ = ["MAX_VALUE_CHARS", "observe", "trace_monitor", "wrap_inplace_trace"]

F = TypeVar("F", bound=Callable[..., Any])

SCOPE = "rollout_proxy.sdk"
#: the longest ``input.value`` / ``output.value`` kept; longer JSON is cut and says by how much
MAX_VALUE_CHARS = 8192
#: a trajectory's token arrays stay out of span attributes (the proxy has them by response id)
TOKEN_FIELDS = frozenset({"total_token_ids", "total_loss_weight", "total_token_logprobs", "routed_experts"})
DEFAULT_SERVICE_NAME = "rollout-plugin"
WRAPPED_MARK = "__rollout_proxy_traced__"

log = logging.getLogger(__name__)

#: the response ids of the LLM calls made inside the innermost ``trace_monitor`` span
_response_ids: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("rollout_response_ids", default=None)
#: installing the environment's exporter happens once per process, whichever thread gets there first
_install_lock = threading.Lock()


# -- the tracer ------------------------------------------------------------------------------


def _otlp_configured() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _install_otlp_provider() -> None:
    """A batch-exporting OTLP/HTTP provider as the global one (the ``OTEL_*`` variables configure it)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning("OTEL_EXPORTER_OTLP_* is set but %s is missing: pip install 'rollout-proxy[otlp]'", exc.name)
        trace.set_tracer_provider(trace.NoOpTracerProvider())
        return
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def install_from_environment() -> None:
    """Install the environment's OTLP exporter as the global provider, if it names one and none is set."""
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) and _otlp_configured():
        with _install_lock:
            if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
                _install_otlp_provider()


class _Tracer:
    """One traced function's (or client's) way to its tracer: the environment is read at its first call;
    while the process has no tracer provider there is no tracer, and the call goes untraced."""

    __slots__ = ("_checked", "_tracer")

    def __init__(self) -> None:
        self._checked = False
        self._tracer: trace.Tracer | None = None

    def get(self) -> trace.Tracer | None:
        if self._tracer is not None:
            return self._tracer
        if not self._checked:
            self._checked = True
            install_from_environment()
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            return None  # no provider (yet): OpenTelemetry's no-op, skipped altogether
        self._tracer = trace.get_tracer(SCOPE)  # a provider, once set, stays for the process
        return self._tracer


# -- values as attributes --------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, Trajectory):
        return value.model_dump(mode="json", exclude=set(TOKEN_FIELDS))
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, RolloutInferenceProxy):
        return {"proxy": type(value).__name__, "session_id": _session_id(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items() if k not in TOKEN_FIELDS}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if hasattr(value, "model_dump"):  # an openai response object
        return _jsonable(value.model_dump(mode="json", exclude_none=True))
    return repr(value)


def preview(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """``value`` as JSON for an attribute: token arrays left out, cut at ``limit`` characters."""
    try:
        text = json.dumps(_jsonable(value), ensure_ascii=False, default=repr)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…(+{len(text) - limit} chars)"


def _session_id(proxy: RolloutInferenceProxy) -> str | None:
    """The session's id, only when known without I/O (a lazily opened session may not exist yet)."""
    if proxy.mode is not Mode.Training or not proxy.is_open:
        return None
    try:
        return proxy.session_id
    except Exception:  # a token that is not a session JWT: nothing to link
        return None


def _arguments(signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if signature is None:
        return {"args": list(args), **kwargs}
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return {"args": list(args), **kwargs}
    return dict(bound.arguments)


def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


# -- one traced call, sync or async ------------------------------------------------------------


class _Call:
    """What a traced function's span records before and after the call."""

    def collecting(self) -> contextlib.AbstractContextManager[object]:
        """The context the call runs in (a plugin's collects the response ids of its LLM calls)."""
        return contextlib.nullcontext()

    def start(self, span: trace.Span, arguments: dict[str, Any]) -> None:
        span.set_attribute("input.value", preview(arguments))

    def finish(self, span: trace.Span, arguments: dict[str, Any], result: Any) -> None:
        span.set_attribute("output.value", preview(result))


def _traced(function: F, name: str, call: _Call) -> F:
    """``function`` with a span around each call (a coroutine function stays one)."""
    signature = _signature(function)
    tracers = _Tracer()

    @contextlib.contextmanager
    def span_of(
        tracer: trace.Tracer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Iterator[tuple[trace.Span, dict[str, Any]]]:
        with call.collecting(), tracer.start_as_current_span(name) as span:
            arguments = _arguments(signature, args, kwargs) if span.is_recording() else {}
            if span.is_recording():
                call.start(span, arguments)
            yield span, arguments

    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            tracer = tracers.get()
            if tracer is None:
                return await function(*args, **kwargs)
            with span_of(tracer, args, kwargs) as (span, arguments):
                result = await function(*args, **kwargs)
                if span.is_recording():
                    call.finish(span, arguments, result)
                return result

        return traced_async  # type: ignore[return-value]

    @functools.wraps(function)
    def traced(*args: Any, **kwargs: Any) -> Any:
        tracer = tracers.get()
        if tracer is None:
            return function(*args, **kwargs)
        with span_of(tracer, args, kwargs) as (span, arguments):
            result = function(*args, **kwargs)
            if span.is_recording():
                call.finish(span, arguments, result)
            return result

    return traced  # type: ignore[return-value]


# -- @observe() --------------------------------------------------------------------------------


@overload
def observe(function: F, /) -> F: ...
@overload
def observe(function: None = None, /, *, name: str | None = None) -> Callable[[F], F]: ...
def observe(function: Callable[..., Any] | None = None, /, *, name: str | None = None) -> Any:
    """A span per call of any function (sync or async), its arguments and result attached.

    ``@observe()`` as in the seed, or ``@observe`` / ``@observe(name="tool lookup")``."""

    def decorate(target: F) -> F:
        return _traced(target, name or target.__qualname__, _Call())

    return decorate(function) if function is not None else decorate


# -- @trace_monitor ----------------------------------------------------------------------------


class _PluginCall(_Call):
    """A rollout's or grader's span: what links it to the proxy's records, besides input and output."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[str]]:
        """A fresh list for the response ids of this call's LLM calls (``_record_answer`` appends)."""
        ids: list[str] = []
        token = _response_ids.set(ids)
        try:
            yield ids
        finally:
            _response_ids.reset(token)

    def start(self, span: trace.Span, arguments: dict[str, Any]) -> None:
        span.set_attribute("rollout_proxy.plugin.kind", self.kind)
        span.set_attribute("rollout_proxy.plugin.name", self.name)
        context = arguments.get("context")
        if isinstance(context, PluginContext):
            span.set_attribute("rollout_proxy.training_step", context.current_training_step)
            if context.model_customization_job_id:
                span.set_attribute("rollout_proxy.job_id", context.model_customization_job_id)
        proxy = arguments.get("proxy")
        session_id = _session_id(proxy) if isinstance(proxy, RolloutInferenceProxy) else None
        if session_id:  # known before the call for a rollout session: a rollout that raises is linked too
            span.set_attribute("rollout_proxy.session_id", session_id)
        trajectories = [arguments.get("trajectory"), *(arguments.get("trajectories") or [])]
        trajectories = [t for t in trajectories if isinstance(t, Trajectory)]
        if trajectories:
            _set_ids(span, "rollout_proxy.session_ids", [t.session_id for t in trajectories])
            _set_ids(span, "rollout_proxy.response_ids", [t.response_id for t in trajectories])
        super().start(span, {k: v for k, v in arguments.items() if k not in ("context", "proxy")})

    def finish(self, span: trace.Span, arguments: dict[str, Any], result: Any) -> None:
        proxy = arguments.get("proxy")
        if isinstance(proxy, RolloutInferenceProxy):
            session_id = _session_id(proxy)
            if session_id:
                span.set_attribute("rollout_proxy.session_id", session_id)
            called = list(_response_ids.get() or [])
            if isinstance(result, GroupRolloutResult):
                called += [response.id for response in result.responses]
            _set_ids(span, "rollout_proxy.response_ids", called)
        status = getattr(result, "status", None)
        if status is not None:
            span.set_attribute("rollout_proxy.status", str(getattr(status, "value", status)))
            if status is PluginStatus.FAILURE:
                span.set_status(trace.Status(trace.StatusCode.ERROR, getattr(result, "error", None) or None))
        if isinstance(result, SingleGraderResult):
            span.set_attribute("rollout_proxy.reward", result.reward)
        elif isinstance(result, GroupGraderResult):
            span.set_attribute("rollout_proxy.rewards", [float(r) for r in result.rewards])
        super().finish(span, arguments, result)


def _set_ids(span: trace.Span, key: str, ids: Sequence[str | None]) -> None:
    unique = list(dict.fromkeys(i for i in ids if i))
    if unique:
        span.set_attribute(key, unique)


def _kind_of(function: Callable[..., Any]) -> str:
    signature = _signature(function)
    names = set(signature.parameters) if signature else set()
    if "proxy" in names:
        return "rollout"
    if names & {"trajectory", "trajectories"}:
        return "grader"
    return "function"


@overload
def trace_monitor(function: F, /) -> F: ...
@overload
def trace_monitor(function: None = None, /, *, name: str | None = None) -> Callable[[F], F]: ...
def trace_monitor(function: Callable[..., Any] | None = None, /, *, name: str | None = None) -> Any:
    """A span per call of a rollout or grader function (sync or async), linked to its session.

    Goes under ``@rollout`` / ``@single_grader`` / ... as in the seed, or over them (a
    ``Plugin`` stays a ``Plugin``). A rollout's span carries the session id and the response
    ids of the LLM calls made in it (clients wrapped with ``wrap_inplace_trace``, and a group
    result's responses); a grader's the session and response ids it grades and the rewards."""

    def decorate(target: Any) -> Any:
        if isinstance(target, Plugin):
            kind = "rollout" if target.spec.kind.is_rollout else "grader"
            return Plugin(_monitored(target.function, kind, name or target.spec.name), target.spec)
        return _monitored(target, _kind_of(target), name or target.__name__)

    return decorate(function) if function is not None else decorate


def _monitored(function: F, kind: str, name: str) -> F:
    return _traced(function, f"{kind} {name}", _PluginCall(kind, name))


# -- wrap_inplace_trace(client) ------------------------------------------------------------------


def _start_llm_span(tracer: trace.Tracer, kwargs: dict[str, Any]) -> contextlib.AbstractContextManager[trace.Span]:
    model = kwargs.get("model")
    name = f"chat {model}" if isinstance(model, str) else "chat"  # the gen_ai convention's span name
    return tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT)


def _send_trace_context(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the current span's ``traceparent`` in ``extra_headers`` (the caller's own headers win)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return kwargs
    headers = kwargs.get("extra_headers")
    return {**kwargs, "extra_headers": {**carrier, **(headers if isinstance(headers, Mapping) else {})}}


def _record_request(span: trace.Span, api: str, kwargs: dict[str, Any]) -> None:
    span.set_attribute("gen_ai.operation.name", "chat")
    span.set_attribute("gen_ai.provider.name", "openai")
    span.set_attribute("rollout_proxy.api", api)
    if isinstance(kwargs.get("model"), str):
        span.set_attribute("gen_ai.request.model", kwargs["model"])
    if kwargs.get("previous_response_id"):
        span.set_attribute("rollout_proxy.previous_response_id", str(kwargs["previous_response_id"]))
    sent = kwargs.get("messages") if api == "chat.completions" else kwargs.get("input")
    span.set_attribute("input.value", preview(sent))
    if kwargs.get("stream"):
        span.set_attribute("rollout_proxy.stream", True)


def _record_answer(span: trace.Span, api: str, answer: Any) -> None:
    """The answer's id, model, usage and output; a stream is returned as is (its chunks are the caller's)."""
    if not hasattr(answer, "model_dump"):
        return
    data = answer.model_dump(mode="json", exclude_none=True)
    if data.get("id"):
        span.set_attribute("gen_ai.response.id", data["id"])
        collected = _response_ids.get()
        if collected is not None:
            collected.append(data["id"])
    if data.get("model"):
        span.set_attribute("gen_ai.response.model", data["model"])
    usage = data.get("usage") or {}
    for ours, theirs in (
        ("input_tokens", ("prompt_tokens", "input_tokens")),
        ("output_tokens", ("completion_tokens", "output_tokens")),
    ):
        value = next((usage[key] for key in theirs if isinstance(usage.get(key), int)), None)
        if value is not None:
            span.set_attribute(f"gen_ai.usage.{ours}", value)
    if api == "chat.completions":
        choices = data.get("choices") or []
        reasons = [str(c.get("finish_reason")) for c in choices if c.get("finish_reason")]
        if reasons:
            span.set_attribute("gen_ai.response.finish_reasons", reasons)
        output: Any = [c.get("message") for c in choices]
    else:
        if data.get("status"):
            span.set_attribute("gen_ai.response.finish_reasons", [str(data["status"])])
        output = data.get("output")
    span.set_attribute("output.value", preview(output))


def _wrap_sync(resource: Any, api: str) -> None:
    original = resource.create
    if getattr(original, WRAPPED_MARK, False):
        return
    tracers = _Tracer()

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        tracer = tracers.get()
        if tracer is None:
            return original(*args, **kwargs)
        with _start_llm_span(tracer, kwargs) as span:
            recording = span.is_recording()
            if recording:
                _record_request(span, api, kwargs)
            answer = original(*args, **_send_trace_context(kwargs))
            if recording:
                _record_answer(span, api, answer)
            return answer

    setattr(create, WRAPPED_MARK, True)
    resource.create = create


def _wrap_async(resource: Any, api: str) -> None:
    original = resource.create
    if getattr(original, WRAPPED_MARK, False):
        return
    tracers = _Tracer()

    @functools.wraps(original)
    async def create(*args: Any, **kwargs: Any) -> Any:
        tracer = tracers.get()
        if tracer is None:
            return await original(*args, **kwargs)
        with _start_llm_span(tracer, kwargs) as span:
            recording = span.is_recording()
            if recording:
                _record_request(span, api, kwargs)
            answer = await original(*args, **_send_trace_context(kwargs))
            if recording:
                _record_answer(span, api, answer)
            return answer

    setattr(create, WRAPPED_MARK, True)
    resource.create = create


C = TypeVar("C", bound=openai.OpenAI | openai.AsyncOpenAI)


def wrap_inplace_trace(client: C) -> C:
    """A span per LLM call of an ``openai.OpenAI`` / ``openai.AsyncOpenAI`` client (chat and
    responses), with the response id and usage; the call's ``traceparent`` goes with the request.

    Wraps the client in place (and returns it), before or after the SDK's ``wrap_*_inplace``;
    wrapping twice is a no-op."""
    wrap = _wrap_async if isinstance(client, openai.AsyncOpenAI) else _wrap_sync
    for resource, api in ((client.chat.completions, "chat.completions"), (client.responses, "responses")):
        wrap(resource, api)
    return client
